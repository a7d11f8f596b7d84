#!/usr/bin/env bash
# Entry point of docker/ascend.Dockerfile: load the CANN environment (the toolkit, and NNAL's
# ATB when the base image has it), then run the command. torch_npu needs these variables
# (library paths, ASCEND_* settings) in every process that imports it.
set -e
for env in /usr/local/Ascend/ascend-toolkit/set_env.sh /usr/local/Ascend/nnal/atb/set_env.sh; do
    if [ -f "$env" ]; then
        # shellcheck disable=SC1090
        source "$env"
    fi
done
exec "$@"
