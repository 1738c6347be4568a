# Sourced by the bench/gpu_*.sh scripts on the GPU machine, from the repository root: DALI from the
# stash (../shared/device/dali-bundle.sh), and fasttrain installed editable without dependencies,
# so that kernels/ imports as fasttrain.kernels (pyproject's package-dir), as it does here.
bash /tmp/dali-stash/unpack.sh install > /dev/null || exit 1
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip-install.log 2>&1 \
  || { cat /tmp/pip-install.log; exit 1; }
export PYTHONPATH=/tmp/dali-site PYTHONUNBUFFERED=1 FASTTRAIN_CACHE=/tmp/fasttrain-cache
