from __future__ import annotations

import asyncio
import base64
import inspect
import io

import numpy as np
import pytest
from omni_rewards_testutils import ServerThread, solid
from PIL import Image

from omni_rewards import RewardError, load_reward

pytest.importorskip("starlette")


def check_request_with_the_sdk(body: dict) -> None:
    """``body`` is a chat completion request as the official OpenAI SDK defines it: every key a
    parameter of ``chat.completions.create``, every message part one of its content part
    types (checked with the SDK's own TypedDicts)."""
    from openai.resources.chat.completions import Completions
    from openai.types.chat import ChatCompletionContentPartParam, ChatCompletionUserMessageParam
    from pydantic import TypeAdapter

    sdk_options = {"self", "extra_headers", "extra_query", "extra_body", "timeout"}
    params = set(inspect.signature(Completions.create).parameters) - sdk_options
    assert set(body) <= params, f"not parameters of the OpenAI SDK: {set(body) - params}"
    # validation drops keys a TypedDict does not declare: a misspelt one shows as a difference
    user_message = TypeAdapter(ChatCompletionUserMessageParam)
    part = TypeAdapter(ChatCompletionContentPartParam)
    for message in body["messages"]:
        head = {**message, "content": ""}
        assert user_message.validate_python(head) == head, f"not a user message: {head}"
        for content in message["content"]:
            assert part.validate_python(content) == content, f"not a content part: {content}"


def sdk_response(model: str, answer: str) -> dict:
    """A chat completion as the OpenAI SDK's own model writes it."""
    from openai.types.chat import ChatCompletion, ChatCompletionMessage
    from openai.types.chat.chat_completion import Choice

    message = ChatCompletionMessage(role="assistant", content=answer)
    choice = Choice(index=0, finish_reason="stop", message=message)
    completion = ChatCompletion(
        id="chatcmpl-0", object="chat.completion", created=0, model=model, choices=[choice]
    )
    return completion.model_dump(mode="json")


def _fake_judge():
    """An OpenAI-compatible chat endpoint on 127.0.0.1 that checks each request, and writes each
    answer, with the official SDK's types: rates red images 8/10, others 2/10; in OCR mode
    answers "Hello World". Fails on demand to exercise retries."""
    from openai.types.shared import ErrorObject
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    state = {"calls": 0, "fail_next": [], "answer": None, "delay": 0.0, "last_body": None}

    async def chat(request):
        state["calls"] += 1
        if state["fail_next"]:
            code = state["fail_next"].pop(0)
            busy = ErrorObject(message="busy", type="server_error", code=None, param=None)
            return JSONResponse(
                {"error": busy.model_dump(mode="json")},
                status_code=code,
                headers={"retry-after": "0"},
            )
        if state["delay"]:
            await asyncio.sleep(state["delay"])
        body = await request.json()
        try:  # a real server answers a request it cannot read with 400 and says why
            check_request_with_the_sdk(body)
        except (AssertionError, ValueError) as exc:
            return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
        state["last_body"] = body
        assert body["temperature"] == 0
        content = body["messages"][0]["content"]
        url = next(c["image_url"]["url"] for c in content if c["type"] == "image_url")
        text = next(c["text"] for c in content if c["type"] == "text")
        img = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))))
        if state["answer"] is not None:
            answer = state["answer"]
        elif "Transcribe" in text:
            answer = "Hello  World"
        else:
            answer = "Score: 8/10" if img[..., 0].mean() > 200 and img[..., 2].mean() < 50 else "2"
        return JSONResponse(sdk_response(body["model"], answer))

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
    return app, state


@pytest.fixture(scope="module")
def judge():
    app, state = _fake_judge()
    srv = ServerThread(app)
    yield srv, state
    srv.stop()


def test_score_mode_and_retries(judge):
    srv, state = judge
    state.update(answer=None, fail_next=[429, 503], delay=0.0)
    r = load_reward("vlm_judge", url=f"{srv.url}/v1", backoff=0.01, concurrency=1)
    out = r(
        images=np.stack([solid((255, 0, 0)), solid((0, 0, 255))]),
        prompts=["a red square", "a red square"],
    )
    np.testing.assert_allclose(out.scores, [0.8, 0.2])
    assert r.stats["retries"] == 2
    assert out.details["answer"].tolist() == ["Score: 8/10", "2"]


def test_the_official_sdk_sends_our_request(judge):
    """The request the reward sent, given to the official OpenAI SDK as keyword arguments, is
    accepted (an unknown parameter is a TypeError there) and answered."""
    import openai

    srv, state = judge
    state.update(answer=None, fail_next=[], delay=0.0)
    r = load_reward("vlm_judge", url=f"{srv.url}/v1", model="judge-model", max_tokens=16)
    r(images=np.stack([solid((255, 0, 0))]), prompts=["a red square"])
    body = state["last_body"]
    assert body["model"] == "judge-model" and body["max_tokens"] == 16
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
    completion = client.chat.completions.create(**body)
    assert completion.choices[0].message.content == "Score: 8/10"
    with pytest.raises(TypeError):  # the SDK does refuse a parameter it does not have
        client.chat.completions.create(**body, max_token=16)
    for bad_part in ({"type": "image_url"}, {"type": "text", "text": "x", "detial": "high"}):
        with pytest.raises((AssertionError, ValueError)):  # and the check a misnamed part
            check_request_with_the_sdk(
                {**body, "messages": [{"role": "user", "content": [bad_part]}]}
            )


def test_ocr_mode(judge):
    srv, state = judge
    state.update(answer=None, fail_next=[], delay=0.0)
    r = load_reward("vlm_judge", url=f"{srv.url}/v1", mode="ocr")
    out = r(images=np.stack([solid((0, 0, 0))] * 2), prompts=['"hello world"', '"goodbye"'])
    assert out.scores[0] == 1.0 and out.scores[1] < 0.5


def test_errors(judge):
    srv, state = judge
    state.update(answer="I cannot say", fail_next=[], delay=0.0)
    r = load_reward("vlm_judge", url=f"{srv.url}/v1", retries=0)
    with pytest.raises(
        RewardError, match="sample 0: no number in the judge's answer 'I cannot say'"
    ):
        r(images=np.stack([solid((0, 0, 0))]), prompts=["x"])
    state.update(answer="5", fail_next=[400])
    with pytest.raises(RewardError, match="HTTP 400"):
        r(images=np.stack([solid((0, 0, 0))]), prompts=["x"])
    state.update(fail_next=[500, 500, 500])
    r2 = load_reward("vlm_judge", url=f"{srv.url}/v1", retries=2, backoff=0.01)
    with pytest.raises(RewardError, match="failed after 3 tries: HTTP 500"):
        r2(images=np.stack([solid((0, 0, 0))]), prompts=["x"])
    state.update(fail_next=[], delay=1.0)
    slow = load_reward("vlm_judge", url=f"{srv.url}/v1", retries=1, backoff=0.01, timeout=0.2)
    with pytest.raises(RewardError, match="Timeout"):
        slow(images=np.stack([solid((0, 0, 0))]), prompts=["x"])
    state.update(delay=0.0)
    with pytest.raises(ValueError, match="url"):
        load_reward("vlm_judge")
