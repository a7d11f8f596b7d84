"""Build hook: the recipes ship inside the omni-train wheel as ``omni_train/recipes``.

The recipes live at the repository root (``recipes/``), outside this package's folder, so a
plain ``[tool.hatch.build] include`` cannot reach them. The hook takes them from the repository
(building from a checkout) or from the sdist's own ``recipes/`` (building a wheel from the
sdist, which this hook also fills). Editable installs get nothing: there
``omni_train.recipes_cli`` reads the checkout's ``recipes/`` directly.
"""

from __future__ import annotations

from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class RecipesBuildHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        if self.target_name == "wheel" and version == "editable":
            return
        root = Path(self.root)
        candidates = (root / "recipes", root.parent.parent / "recipes")
        source = next((c for c in candidates if (c / "quickstart.yaml").is_file()), None)
        if source is None:
            raise FileNotFoundError(
                "omni-train build: no recipes/ folder (looked in "
                f"{', '.join(str(c) for c in candidates)})"
            )
        target = "omni_train/recipes" if self.target_name == "wheel" else "recipes"
        build_data["force_include"][str(source)] = target
