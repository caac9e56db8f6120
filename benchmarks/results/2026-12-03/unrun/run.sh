python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/trl-*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
timeout 200 python3 .gpu_probe/budget_ab.py 2>&1 | grep -v "stand-in" | tail -5
cp .gpu_probe/budget_ab.py $OUT/
