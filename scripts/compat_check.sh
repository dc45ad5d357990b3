#!/usr/bin/env bash
# The CPU suite on another torch release than CI's 2.13.0, in a venv of its own (default /tmp/fa_compat_<torch>):
#   bash scripts/compat_check.sh [torch version, default 2.14.1]
# torch 2.14.1 is a CUDA build on this machine's local disk (about 5.4 GB in the venv; it runs on the CPU) and brings
# its own triton (3.8.0), so the interpreter tests run that Triton's frontend too. The project says it works on torch
# 2.11 through 2.15: CI covers 2.13, the GPU machine 2.11, this script what else the machine can install.
# This machine's pip caps torch at 2.14.1 (/etc/xdg/pip/constraints.txt: the releases on its disk); torch 2.15.0
# (with triton 3.9.0) comes from PyPI past the cap: PIP_CONSTRAINT=/dev/null bash scripts/compat_check.sh 2.15.0
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:-2.14.1}"
venv="${COMPAT_VENV:-/tmp/fa_compat_$version}"
[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
"$venv/bin/pip" install -q "torch==$version" "numpy<2.4" pytest pytest-xdist hypothesis matplotlib
"$venv/bin/pip" install -q "nvidia-cutlass-dsl==4.8.1" \
  || echo "nvidia-cutlass-dsl not installed: CuTe compile tests skip"
"$venv/bin/python" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# the source tree on the path rather than an editable install: the venv stays reusable across checkouts
PYTHONPATH="$PWD" TRITON_INTERPRET=1 "$venv/bin/python" -m pytest tests -q -n 2 -p no:cacheprovider
