"""The venv that tools/setup_venv.sh builds: every engine imports, nothing broken left behind."""

import subprocess
import sys

import pytest

from tests.support.processes import REPO


@pytest.mark.slow
def test_engines_import_in_a_fresh_interpreter():
    code = (
        # on CPU the trainer imports megatron with its jit fuser off from the start: no torch inductor at import
        "import sys, torch\n"
        "from rollhpc.models import megatron_cpu\n"
        "megatron_cpu.import_megatron()\n"
        "import megatron.core.jit as jit\n"
        "assert jit.jit_fuser is jit.noop_decorator and torch.compile is not megatron_cpu._identity_compile\n"
        "assert 'torch._inductor.compile_fx' not in sys.modules, 'megatron pulled in torch inductor on CPU'\n"
        "import importlib.util, torch, megatron.core, mpi4py.MPI, submitit, hydra, h5py, transformers, safetensors\n"
        "import vllm\n"
        "assert torch.__version__.startswith('2.13.0') and '+cpu' in torch.__version__, torch.__version__\n"
        "assert megatron.core.__version__ == '0.16.1', megatron.core.__version__\n"
        "assert importlib.util.find_spec('psutil'), 'megatron-core needs psutil'\n"
        "assert importlib.util.find_spec('torchvision') is None, 'CUDA torchvision left behind breaks vllm'\n"
        "print('ok', vllm.__version__)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={"VLLM_LOGGING_LEVEL": "ERROR", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("ok 0.32.0")
