#!/usr/bin/env bash
# Source on the GPU machine from the repository root (no registry there): installs the wheels carried under .dev/
# into /tmp/site and puts them on PYTHONPATH. .dev/fa4/fa4site.tar.xz holds FlashAttention-4 and its CuTe DSL
# dependencies unpacked (flash-attn-4 4.0.0b36, nvidia-cutlass-dsl 4.8.1 + libs, apache-tvm-ffi, torch-c-dlpack-ext,
# quack-kernels), for Python 3.12 (xz with a 256 MiB dictionary: 59 MB); .dev/diffusers and .dev/av hold wheels.
# Anything already unpacked in /tmp stays (warm machine).
# Unpacked under a site-packages folder: quack fingerprints its epilogues' dependencies and treats only code under
# site-packages (or dist-packages) as installed, fingerprinted by name (the GEMM epilogue experiment, NOTES.md).
# Then, from the repository root: python -m benchmarks.NAME (the tests: python -m pytest -m cuda).
FA4_SITE=/tmp/h3/site-packages/fa4site
if [ -f .dev/fa4/fa4site.tar.xz ] && [ ! -d "$FA4_SITE" ]; then
  mkdir -p /tmp/h3/site-packages && tar -xJf .dev/fa4/fa4site.tar.xz -C /tmp/h3/site-packages
fi
# diffusers 0.42.1 and importlib_metadata unpacked (xz packs them smaller than their wheels).
if [ -f .dev/fa4/diffusers_site.tar.xz ] && [ ! -d /tmp/dsite ]; then
  tar -xJf .dev/fa4/diffusers_site.tar.xz -C /tmp
fi
for folder in .dev/diffusers .dev/av; do
  if compgen -G "$folder/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$folder"/*.whl
  fi
done
export PYTHONPATH="/tmp/site:/tmp/dsite:$FA4_SITE:$FA4_SITE/nvidia_cutlass_dsl/dsl_packages:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
