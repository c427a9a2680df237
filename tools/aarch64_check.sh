#!/bin/sh
# glmc on aarch64 (Kunpeng 920, Phytium, Graviton, ...): train the GLM example 3 steps with the
# eager backend and with Inductor (which compiles C++ for this CPU), print each backend's losses.
#
# On an aarch64 server, in a checkout of glmc:
#   python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e .
#   PYTHON=.venv/bin/python tools/aarch64_check.sh [STEPS]
#
# Compare with an x86 run of the same command (tests/test_aarch64.py does, under qemu): fp32
# losses agree to rtol 1e-4 (different BLAS kernels sum in different orders), not bit-for-bit.
#
# Under qemu-aarch64 on an x86 host (tools/aarch64_sysroot.sh --torch DEST first; DEST/python3.11
# is the emulated Python):
#   PYTHON=DEST/python3.11 PYTHONPATH=DEST/glmc:DEST/torch CXX=aarch64-linux-gnu-g++ \
#   CPLUS_INCLUDE_PATH=DEST/rootfs/usr/include TORCHINDUCTOR_CPP_MARCH=armv8.2-a+fp16+dotprod \
#   TORCHINDUCTOR_COMPILE_THREADS=1 tools/aarch64_check.sh
# (Inductor then compiles with the host's cross compiler, at native speed, in one process: its
# compile workers would be aarch64 processes started without qemu.)
#
# Output: one line per backend, `BACKEND [loss1, loss2, ...] SECONDS`; exit status 1 if a run
# fails or prints no losses.
set -eu
EXAMPLE=$(cd "$(dirname "$0")/.." && pwd)/examples/glm.py
PYTHON=${PYTHON:-python3}
case $PYTHON in /*) ;; */*) PYTHON=$PWD/$PYTHON ;; esac  # a relative path, before the cd
# run outside the checkout: its glmc/ folder lacks glmc.passes and glmc.backends (pyproject's
# package-dir maps them), so the installed glmc must be the one imported
cd "${TMPDIR:-/tmp}"
STEPS=${1:-3}
status=0
for backend in eager inductor; do
    start=$(date +%s)
    # shellcheck disable=SC2086  # PYTHON may be a command with arguments (qemu)
    if out=$($PYTHON -m glmc compile "$EXAMPLE" --backend "$backend" --steps "$STEPS" \
            --profile generic-cpu 2>&1); then
        losses=$(printf '%s\n' "$out" | sed -n 's/^step  *[0-9][0-9]*  *loss  *\([-0-9.eE+naif]*\).*/\1/p' \
                 | paste -sd, -)
    else
        losses=""
    fi
    if [ -z "$losses" ]; then
        printf '%s\n' "$out" | tail -20 >&2
        echo "$backend FAILED"
        status=1
    else
        echo "$backend [$losses] $(( $(date +%s) - start ))"
    fi
done
exit $status
