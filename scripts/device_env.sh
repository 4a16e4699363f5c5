# Sourced first by the scripts/gpu_*.sh device-tool scripts: `source scripts/device_env.sh LOG`.
# Installs the carried wheels (.whl, plus .devcarry/b/wheels when carried) into /tmp/site, sets
# the environment the device runs need, and tees everything printed after it into $OUT/LOG.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl $(ls .devcarry/b/wheels/*.whl 2>/dev/null) || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 QPALETTE_CACHE=/tmp/qpcache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/$1") 2>&1
