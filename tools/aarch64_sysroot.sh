#!/bin/sh
# An aarch64 Python with Apache TVM's runtime, to run TVM-built steps (glmc.export.export_tvm
# with target "kunpeng920") under qemu-aarch64 on an x86_64 Debian/Ubuntu host:
#
#   tools/aarch64_sysroot.sh [--torch] [DEST]   # default ~/.cache/glmc/aarch64 (root: apt)
#   PYTHONPATH=DEST/site qemu-aarch64 -L DEST/rootfs DEST/rootfs/usr/bin/python3.11 run_tvm.py
#
# --torch also installs torch's aarch64 wheel (PyPI's torch==2.13.0 for aarch64 is a CUDA build:
# its nvidia-* wheels come too, ~5 GB, unused on a CPU) into DEST/torch and glmc into
# DEST/glmc, and the aarch64 cross g++ (Inductor compiles with it at native speed), for
# tools/aarch64_check.sh under qemu. qemu-user shows the program the x86 host's /proc/cpuinfo and
# no MIDR_EL1 in sysfs, on which torch's CPU detection (cpuinfo, oneDNN's xbyak_aarch64)
# crashes: DEST/rootfs gets a /proc/cpuinfo and midr_el1 files of a Kunpeng 920 (TaiShan v110,
# MIDR 0x481fd010), which qemu's -L prefix shows the program instead.
#
# Installs the cross linker and qemu (apt), adds the arm64 architecture to apt to download
# Debian's arm64 python3.11 and the libraries it and TVM load (apt-get download + dpkg -x, not
# installed), and unpacks the aarch64 wheels of apache-tvm, apache-tvm-ffi, numpy, ml_dtypes,
# safetensors.
set -eu
TORCH=0
if [ "${1:-}" = "--torch" ]; then TORCH=1; shift; fi
DEST=${1:-$HOME/.cache/glmc/aarch64}
mkdir -p "$DEST" && DEST=$(cd "$DEST" && pwd)  # absolute: the wrapper script bakes it in
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PIP=${PIP:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/pip}
PY_VER=3.11
FFI=$("$PIP" show apache-tvm-ffi 2>/dev/null | sed -n "s/^Version: //p")
apt-get install -y gcc-aarch64-linux-gnu qemu-user >/dev/null
dpkg --add-architecture arm64
apt-get update >/dev/null
mkdir -p "$DEST/debs" "$DEST/rootfs" "$DEST/site" "$DEST/wheels"
cd "$DEST/debs"
apt-get download python$PY_VER-minimal:arm64 libpython$PY_VER-minimal:arm64 \
    libpython$PY_VER-stdlib:arm64 libc6:arm64 libstdc++6:arm64 libgcc-s1:arm64 libgomp1:arm64 \
    libexpat1:arm64 zlib1g:arm64 libffi8:arm64 libbz2-1.0:arm64 liblzma5:arm64 libcrypt1:arm64 \
    libuuid1:arm64 libssl3:arm64 libncursesw6:arm64 libtinfo6:arm64 libsqlite3-0:arm64
for d in *.deb; do dpkg -x "$d" "$DEST/rootfs"; done
cd "$DEST/wheels"
"$PIP" download --only-binary=:all: --no-deps --python-version $PY_VER \
    --platform manylinux2014_aarch64 --platform manylinux_2_28_aarch64 \
    apache-tvm==0.27.0.post1 "apache-tvm-ffi${FFI:+==$FFI}" numpy ml_dtypes typing_extensions \
    safetensors >/dev/null
for w in *.whl; do python3 -m zipfile -e "$w" "$DEST/site/"; done
if [ "$TORCH" = 1 ]; then
    apt-get install -y g++-aarch64-linux-gnu >/dev/null
    TAGS="--platform manylinux2014_aarch64 --platform linux_aarch64"
    for v in $(seq 17 36); do TAGS="$TAGS --platform manylinux_2_${v}_aarch64"; done
    # shellcheck disable=SC2086
    "$PIP" install -q --only-binary=:all: --python-version $PY_VER $TAGS --target "$DEST/torch" \
        torch==2.13.0 networkx numpy tqdm safetensors matplotlib scipy zstandard
    "$PIP" install -q --no-deps --target "$DEST/glmc" "$ROOT"
    NCPU=$(nproc)
    mkdir -p "$DEST/rootfs/proc"
    : > "$DEST/rootfs/proc/cpuinfo"
    i=0
    while [ $i -lt "$NCPU" ]; do
        printf 'processor\t: %s\nBogoMIPS\t: 200.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma dcpop asimddp asimdfhm\nCPU implementer\t: 0x48\nCPU architecture: 8\nCPU variant\t: 0x1\nCPU part\t: 0xd01\nCPU revision\t: 0\n\n' $i >> "$DEST/rootfs/proc/cpuinfo"
        mkdir -p "$DEST/rootfs/sys/devices/system/cpu/cpu$i/regs/identification"
        echo 0x00000000481fd010 > "$DEST/rootfs/sys/devices/system/cpu/cpu$i/regs/identification/midr_el1"
        i=$((i + 1))
    done
    # Inductor's C++ includes Python.h (the cross g++ finds pyconfig.h's multiarch part through
    # CPLUS_INCLUDE_PATH=DEST/rootfs/usr/include)
    (cd "$DEST/debs" && apt-get download libpython$PY_VER-dev:arm64 && \
        dpkg -x libpython$PY_VER-dev_*_arm64.deb "$DEST/rootfs")
    # DEST/python3.11: the aarch64 Python under qemu. Python's own subprocesses (Inductor probes
    # its vector ISA with sys.executable) cannot exec an aarch64 binary without binfmt_misc:
    # sitecustomize points sys.executable back at this wrapper.
    mkdir -p "$DEST/qemu"
    printf 'import os, sys\nif os.environ.get("GLMC_QEMU_PYTHON"):\n    sys.executable = os.environ["GLMC_QEMU_PYTHON"]\n' > "$DEST/qemu/sitecustomize.py"
    cat > "$DEST/python$PY_VER" <<EOF
#!/bin/sh
export GLMC_QEMU_PYTHON="$DEST/python$PY_VER" PYTHONPATH="$DEST/qemu\${PYTHONPATH:+:\$PYTHONPATH}"
exec qemu-aarch64 -cpu neoverse-n1 -L "$DEST/rootfs" "$DEST/rootfs/usr/bin/python$PY_VER" "\$@"
EOF
    chmod +x "$DEST/python$PY_VER"
fi
echo "$DEST"
