"""The distribution maps four import packages from four folders; every subpackage is listed."""

import pathlib

import tomllib
from support import ROOT


def test_every_subpackage_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    dirs = cfg["package-dir"]
    found = set()
    for name, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    missing = found - listed
    assert not missing, f"add these to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"


def test_import_names():
    import colossal_lab
    import colossal_lab.engine
    import colossal_lab.kernels
    import colossal_lab.widgets
    from colossal_lab.engine import telemetry

    assert pathlib.Path(colossal_lab.engine.__file__).parent.name == "engine"
    assert pathlib.Path(colossal_lab.widgets.__file__).parent.name == "widgets"
    assert callable(telemetry.emit)


# ---- the torch floor --------------------------------------------------------------------------
# Each torch API the engine relies on, with the first torch release that has it (read from the
# released wheels' sources: 2.4.1, 2.5.1, 2.6.0, 2.7.1, 2.8.0, 2.9.1, 2.10.0), where the engine
# uses it, and a check on the installed torch. The floor must be the newest of these: a floor
# above them is unjustified, one below them is a lie. "2.4" means "present in 2.4.1, the oldest
# release checked" — below the floor either way.

def _sig_has(fn, name):
    import inspect

    return name in inspect.signature(fn).parameters


def _step_has_return_outputs():
    from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleaved1F1B

    return _sig_has(Schedule1F1B.step, "return_outputs") and _sig_has(ScheduleInterleaved1F1B.step, "return_outputs")


def _p2p_seams():
    from torch.distributed.pipelining import schedules as S

    return callable(S._batch_p2p) and callable(S._wait_batch_p2p)


def _scale_grads():
    from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleaved1F1B

    return _sig_has(Schedule1F1B.__init__, "scale_grads") and _sig_has(ScheduleInterleaved1F1B.__init__, "scale_grads")


def _fsdp2_public():
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard  # noqa: F401

    return True


def _zbv():
    from torch.distributed.pipelining import ScheduleZBVZeroBubble  # noqa: F401

    return True


def _stage_infers_shapes():
    import inspect

    from torch.distributed.pipelining import PipelineStage

    return inspect.signature(PipelineStage.__init__).parameters["input_args"].default is None


def _dtensor_public():
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: F401

    return True


def _zb1p():
    from torch.distributed.pipelining import ScheduleInterleavedZeroBubble  # noqa: F401

    return True


def _stage_seams():
    from torch.distributed.pipelining.stage import _PipelineStageBase as B

    return all(callable(getattr(B, n, None)) for n in (
        "forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk",
        "get_fwd_recv_ops", "get_bwd_recv_ops", "get_fwd_send_ops", "get_bwd_send_ops"))


def _pipelining_base():
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B  # noqa: F401

    return True


def _mesh_from_group():
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: F401

    return callable(DeviceMesh.from_group)


def _dcp_state_dict():
    import dataclasses

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (  # noqa: F401
        StateDictOptions,
        _init_optim_state,
        get_model_state_dict,
        set_model_state_dict,
    )

    fields = {f.name for f in dataclasses.fields(StateDictOptions)}
    return {"full_state_dict", "cpu_offload", "strict", "flatten_optimizer_state_dict"} <= fields and callable(dcp.save)


def _tp_plans():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: F401

    return True


def _post_accumulate_hook():
    import torch

    return hasattr(torch.Tensor, "register_post_accumulate_grad_hook")


def _float8():
    import torch

    return hasattr(torch, "float8_e4m3fn")


def _zero_redundancy():
    from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: F401

    return True


TORCH_APIS = [
    # (first release, what, engine file that uses it, text in that file, check on the installed torch)
    ((2, 10), "PipelineSchedule.step(..., return_outputs=)",
     "engine/pipeline/runtime.py", "return_outputs=", _step_has_return_outputs),
    ((2, 8), "pipelining.schedules._batch_p2p/_wait_batch_p2p (timeline seam)",
     "engine/pipeline/timing.py", "S._wait_batch_p2p", _p2p_seams),
    ((2, 7), "pipeline schedules' scale_grads=", "engine/pipeline/runtime.py", "scale_grads=", _scale_grads),
    ((2, 6), "torch.distributed.fsdp.fully_shard / MixedPrecisionPolicy / CPUOffloadPolicy",
     "engine/plugins/low_level_zero.py",
     "from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard",
     _fsdp2_public),
    ((2, 6), "ScheduleZBVZeroBubble", "engine/pipeline/schedules.py", "ScheduleZBVZeroBubble,", _zbv),
    ((2, 6), "PipelineStage without input_args (shape inference)",
     "engine/pipeline/stage.py", "PipelineStage(mod, s, num_stages, device, group=group)", _stage_infers_shapes),
    ((2, 5), "torch.distributed.tensor public DTensor / distribute_tensor / Replicate / Shard",
     "engine/tensor_parallel.py", "from torch.distributed.tensor import Replicate, Shard", _dtensor_public),
    ((2, 5), "ScheduleInterleavedZeroBubble", "engine/pipeline/schedules.py", "ScheduleInterleavedZeroBubble,", _zb1p),
    ((2, 5), "stage seams forward/backward/backward_weight_one_chunk, get_*_ops",
     "engine/pipeline/timing.py", "backward_weight_one_chunk", _stage_seams),
    ((2, 4), "torch.distributed.pipelining PipelineStage, GPipe, 1F1B, Interleaved1F1B",
     "engine/pipeline/schedules.py", "ScheduleGPipe,", _pipelining_base),
    ((2, 4), "DeviceMesh.from_group, init_device_mesh",
     "engine/plugins/low_level_zero.py", "DeviceMesh.from_group", _mesh_from_group),
    ((2, 4), "checkpoint.state_dict get/set_model_state_dict, StateDictOptions(flatten_optimizer_state_dict)",
     "engine/checkpoint_io/general.py", "StateDictOptions(flatten_optimizer_state_dict=True)", _dcp_state_dict),
    ((2, 4), "tensor.parallel parallelize_module / ColwiseParallel / RowwiseParallel",
     "engine/tensor_parallel.py", "parallelize_module", _tp_plans),
    ((2, 1), "Tensor.register_post_accumulate_grad_hook",
     "engine/gemini/zero_model.py", "register_post_accumulate_grad_hook(", _post_accumulate_hook),
    ((2, 1), "torch.float8_e4m3fn", "engine/mixed_precision/fp8.py", "torch.float8_e4m3fn", _float8),
    ((1, 8), "torch.distributed.optim.ZeroRedundancyOptimizer",
     "engine/plugins/low_level_zero.py", "ZeroRedundancyOptimizer", _zero_redundancy),
]


def _pyproject_torch_floor():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    import re

    found = [re.fullmatch(r"torch\s*>=\s*(\d+)\.(\d+)(?:\.0)?", d.split(";")[0].strip()) for d in deps
             if re.match(r"torch\b", d)]
    assert len(found) == 1 and found[0], f"pyproject.toml: expected one 'torch>=X.Y' dependency, got {deps}"
    return int(found[0].group(1)), int(found[0].group(2))


def test_pyproject_torch_floor_equals_the_engine_constant():
    from colossal_lab.engine import TORCH_FLOOR

    assert _pyproject_torch_floor() == TORCH_FLOOR


def test_torch_floor_is_the_newest_api_the_engine_uses():
    from colossal_lab.engine import TORCH_FLOOR

    assert all(since <= TORCH_FLOOR for since, *_ in TORCH_APIS)
    newest = [what for since, what, *_ in TORCH_APIS if since == TORCH_FLOOR]
    assert newest, f"nothing in TORCH_APIS needs torch {TORCH_FLOOR}: lower the floor to the newest entry"


def test_every_api_behind_the_floor_is_still_used_and_present():
    import torch

    for since, what, path, text, check in TORCH_APIS:
        assert text in (ROOT / path).read_text(), (
            f"{path} no longer contains {text!r}: if {what} is gone, drop it from TORCH_APIS "
            "(and lower the floor if it was the newest)")
        assert check(), f"{what} (torch {since[0]}.{since[1]}) is missing from torch {torch.__version__}"


def _import_engine_with(version: str):
    import subprocess
    import sys

    code = ("import torch\n"
            f"torch.__version__ = {version!r}\n"
            "import colossal_lab.engine\n"
            "print('imported')\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_import_rejects_a_torch_below_the_floor():
    from colossal_lab.engine import TORCH_FLOOR

    major, minor = TORCH_FLOOR
    old = f"{major}.{minor - 1}.1+cu128" if minor else f"{major - 1}.99.0"
    r = _import_engine_with(old)
    assert r.returncode != 0 and "imported" not in r.stdout
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError:"), r.stderr
    assert old in last and f">= {major}.{minor}" in last and "pip install" in last, last


def test_import_accepts_the_installed_torch_and_the_floor_release():
    import torch

    from colossal_lab.engine import TORCH_FLOOR

    r = _import_engine_with(torch.__version__)
    assert r.returncode == 0 and "imported" in r.stdout, r.stderr
    r = _import_engine_with("%d.%d.0a0+git0123abc" % TORCH_FLOOR)  # a vendor build of the floor
    assert r.returncode == 0 and "imported" in r.stdout, r.stderr


def test_version_is_read_without_importing_torch():
    import subprocess
    import sys

    code = ("import sys\n"
            "import colossal_lab.engine as e\n"
            "assert 'torch' not in sys.modules, 'importing the engine package imported torch'\n"
            "v = e._torch_version()\n"
            "import torch\n"
            "assert v == torch.__version__, (v, torch.__version__)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


# ---- the Hugging Face floors ----------------------------------------------------------------------

def test_pyproject_hf_extra_states_the_engines_floors_and_test_includes_it():
    import re

    from colossal_lab.engine.models.hf.version import PEFT_FLOOR, TRANSFORMERS_FLOOR

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    floors = {}
    for dep in extras["hf"]:
        m = re.fullmatch(r"(transformers|peft)\s*>=\s*(\d+)\.(\d+)(?:\.0)?", dep.strip())
        assert m, f"pyproject.toml [hf]: expected 'name>=X.Y', got {dep!r}"
        floors[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    assert floors == {"transformers": TRANSFORMERS_FLOOR, "peft": PEFT_FLOOR}
    assert "colossal-lab[hf]" in extras["test"]  # the tests run what the extra brings


def test_hf_floor_check_names_the_release_the_floor_and_the_fix():
    import pytest

    from colossal_lab.engine.models.hf.version import PEFT_FLOOR, TRANSFORMERS_FLOOR, check_floor

    for package, (major, minor) in (("transformers", TRANSFORMERS_FLOOR), ("peft", PEFT_FLOOR)):
        old = f"{major}.{minor - 1}.2" if minor else f"{major - 1}.99.0"
        with pytest.raises(ImportError, match=rf"needs {package} >= {major}\.{minor}, but {package} {old} .*"
                                              rf"pip install --upgrade '{package}>={major}\.{minor}'"):
            check_floor(package, old)
        check_floor(package, f"{major}.{minor}.0.dev0")  # a development build of the floor passes


def test_boost_refuses_an_hf_model_under_a_transformers_below_the_floor():
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from transformers import LlamaConfig, LlamaForCausalLM\n"
            "from colossal_lab.engine import Booster\n"
            "m = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,\n"
            "                                 num_attention_heads=2, num_key_value_heads=2, vocab_size=32))\n"
            "sys.modules['transformers'].__version__ = '5.0.0'  # the module transformers put there\n"
            "Booster().boost(m, torch.optim.AdamW(m.parameters()))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError:") and "transformers 5.0.0 is installed" in last, r.stderr[-2000:]
