#!/usr/bin/env bash
# The GPU checks (tests/integration/test_gpu.py: the real Learner over NCCL with mixed
# precision and its weight push, the CPU engine on CUDA, an NCCL side group) on a machine
# with CUDA, torch and transformers but maybe nothing else of this project's and no network:
# what the tests need besides (Hydra, pytest) comes from the wheelhouse `make gpu-wheels`
# fills (.gpu-wheels/).
#   bash scripts/gpu_check.sh            # every gpu-marked test, and the CPU twins beside them
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d .gpu-wheels ]; then
    python -m pip install -q --no-index --find-links .gpu-wheels hydra-core omegaconf pytest pytest-timeout
fi
python - <<'PY'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s):",
      [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
PY
exec python -m pytest -q -p no:cacheprovider -rs tests/integration/test_gpu.py "$@"
