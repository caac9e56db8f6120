set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
echo "== zero_gemma $(date +%T)"
timeout 280 python3 .gpu_probe/zero_gemma.py 2>&1 | grep -v -i warn | tee $OUT/zero_gemma.log
echo "== end $(date +%T)"
