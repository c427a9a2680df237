#!/bin/sh
# An aarch64 Python with Apache TVM's runtime, to run TVM-built steps (glmc.export.export_tvm
# with target "kunpeng920") under qemu-aarch64 on an x86_64 Debian/Ubuntu host:
#
#   tools/aarch64_sysroot.sh [DEST]         # default ~/.cache/glmc/aarch64 (needs root: apt)
#   PYTHONPATH=DEST/site qemu-aarch64 -L DEST/rootfs DEST/rootfs/usr/bin/python3.11 run_tvm.py
#
# Installs the cross linker and qemu (apt), adds the arm64 architecture to apt to download
# Debian's arm64 python3.11 and the libraries it and TVM load (apt-get download + dpkg -x, not
# installed), and unpacks the aarch64 wheels of apache-tvm, apache-tvm-ffi, numpy, ml_dtypes,
# safetensors.
set -eu
DEST=${1:-$HOME/.cache/glmc/aarch64}
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
echo "$DEST"
