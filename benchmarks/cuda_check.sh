#!/usr/bin/env bash
# The checks that need a CUDA device, in one run on a GPU node (the device machine here):
# the CUDA tests (tests/kv/test_cuda.py, plus the KV tests that run on a mount) and
# benchmarks/gpu_load.py through a real kvfs mount and on plain directories.
#
#   OUT=/some/dir bash benchmarks/cuda_check.sh
#
# Uses the node's python3 (its own CUDA build of torch). Python packages it lacks can travel
# as wheels in .whl/ and libfuse3 as Debian packages in .debs/ (apt-get download fuse3
# libfuse3-3 libfuse3-dev); pyfuse3 is then compiled from its sdist's generated C.
set -u
OUT=${OUT:-/tmp/cuda-check}
mkdir -p "$OUT"
exec > >(tee "$OUT/cuda_check.log") 2>&1
cd "$(dirname "$0")/.."
nvidia-smi -L
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))'
SITE=/tmp/kvfs-site
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 1
fi
export PYTHONPATH="$PWD:$SITE"
if ! python3 -c 'import pyfuse3' 2>/dev/null; then
    FZ=/tmp/fuse3root
    mkdir -p "$FZ"
    for d in .debs/*.deb; do dpkg -x "$d" "$FZ"; done
    tar xzf .whl/pyfuse3-*.tar.gz -C /tmp
    src=$(ls -d /tmp/pyfuse3-*/ | head -1)
    mkdir -p "$SITE/pyfuse3"
    INC=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
    SUF=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
    gcc -shared -fPIC -O2 -DFUSE_USE_VERSION=32 -I"$INC" -I"$src/Include" -I"$FZ/usr/include/fuse3" \
        "$src/src/pyfuse3/__init__.c" -o "$SITE/pyfuse3/__init__$SUF" \
        -L"$FZ/lib/x86_64-linux-gnu" -l:libfuse3.so.3 -lpthread -lrt || exit 1
    cp "$src"/src/pyfuse3/*.py "$SITE/pyfuse3/"
    export LD_LIBRARY_PATH="$FZ/lib/x86_64-linux-gnu" PATH="$FZ/bin:$PATH"
fi
python3 -c 'import pyfuse3, trio, lmdb, xxhash, kvfs; print("kvfs imports ok")' || exit 1
ls -l /dev/fuse
echo "== CUDA tests"
timeout 300 python3 -m pytest -q -p no:cacheprovider --basetemp=/tmp/pt-cuda -o addopts="" \
    tests/kv/test_cuda.py tests/kv/test_cache.py 2>&1 | tail -40
echo "== gpu_load.py"
M=/tmp/kvfs-gpu
mkdir -p $M /tmp/kvfs-gpu-state /tmp/plain-disk /dev/shm/plain-shm
timeout 120 python3 -m kvfs.cli mount $M --ram 2GiB --nvme /tmp/kvfs-gpu-state/nvme --nvme-size 16GiB
for root in $M /dev/shm/plain-shm /tmp/plain-disk; do
    name=$(basename $root)
    timeout 240 python3 benchmarks/gpu_load.py $root --blocks 512 --runs 5 --json "$OUT/gpu_load_$name.json"
done
timeout 60 python3 -m kvfs.cli umount $M
