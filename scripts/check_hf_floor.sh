#!/usr/bin/env bash
# Run the version-sensitive Hugging Face tests against the oldest transformers and peft colossal-lab claims to
# support (engine/models/hf/version.py: TRANSFORMERS_FLOOR, PEFT_FLOOR; pyproject.toml's [hf] extra says the same).
#   bash scripts/check_hf_floor.sh [DIR] [pytest arguments...]
# DIR (default: a fresh temporary folder) gets a virtual environment that holds only the floor releases
# (and what they pin) and sees everything else of .venv behind them: so torch and the test tools are the
# project's own, and only transformers/peft (and their pins) are older. Needs `bash scripts/setup.sh` first.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
DIR=${1:-$(mktemp -d /tmp/cl-hf-floor.XXXXXX)}
shift || true
TESTS=("$@")
# By default, the tests of what the adapter reads from transformers and peft, whose names and shapes moved
# between releases (engine/models/hf/version.py says which): the tensor-parallel plan and its style names,
# the LM head a 5.5 instance plan leaves out (test_hf_tp; 2D reads the same plan:
# test_hf_tp_nd's four ranks), the pipeline cut from base_model_pp_plan and the base forward a stage runs
# with masks, positions and token types (test_hf_pp, test_hf_pp_inputs), the attention-function registry
# (test_hf_cp), safetensors names and from_pretrained / save_pretrained (test_hf_checkpoint,
# test_export_llama), peft (test_lora), and the planners' meta-device models and plan cuts built from a
# config (the planning tests named below). Left to the installed release: what only composes those
# parts (tp2 x dp2, tp2 x pp2, the four-rank checkpoint and LoRA worlds (FOUR_RANKS), 3D on eight ranks, cp x tp,
# measured memory peaks (test_memory_vocab), an autoplan search, int8 serving).
FOUR_RANKS=()
for t in tests/hybrid/test_hf_checkpoint.py::test_tp2_dp2_checkpoint_loads_in_transformers \
    tests/hybrid/test_hf_checkpoint.py::test_save_pretrained_loads_into_tp2_dp2 \
    tests/hybrid/test_hf_checkpoint.py::test_meta_model_boosted_then_loaded_tp2_dp2 \
    tests/hybrid/test_hf_checkpoint.py::test_pipeline_checkpoint_loads_in_transformers \
    tests/hybrid/test_hf_checkpoint.py::test_save_pretrained_loads_into_pipeline \
    tests/hybrid/test_hf_checkpoint.py::test_meta_model_boosted_then_loaded_into_pipeline \
    tests/hybrid/test_hf_checkpoint.py::test_pipeline_files_match_save_pretrained \
    tests/engine/test_lora.py::test_pipelined_llama_follows_single_process_peft \
    tests/engine/test_lora.py::test_pipelined_llama_adapter_loads_in_peft \
    tests/engine/test_lora.py::test_tp2_pp2_shards_adapters_like_their_base_layer; do
  FOUR_RANKS+=(--deselect "$t")
done
[ ${#TESTS[@]} -gt 0 ] || TESTS=(
  tests/hybrid/test_hf_tp.py --deselect tests/hybrid/test_hf_tp.py::test_tp2_with_dp2_follows_the_curve_on_four_ranks
  tests/hybrid/test_hf_tp_nd.py --deselect tests/hybrid/test_hf_tp_nd.py::test_3d_on_eight_ranks_follows_the_single_process_curve
  tests/hybrid/test_hf_pp.py --deselect tests/hybrid/test_hf_pp.py::test_tp2_by_pp2_follows_the_curve_on_four_ranks
  tests/hybrid/test_hf_pp_inputs.py
  tests/hybrid/test_hf_cp.py --deselect tests/hybrid/test_hf_cp.py::test_cp_composes_with_tensor_parallelism
  tests/hybrid/test_hf_checkpoint.py "${FOUR_RANKS[@]}" tests/engine/test_export_llama.py tests/engine/test_lora.py
  tests/planner/test_memory_hf.py::test_an_hf_config_plans_as_its_model_and_defaults_seq_to_its_context
  tests/planner/test_memory_hf.py::test_tensor_parallel_plans_refuse_what_the_plugin_refuses
  tests/planner/test_layout_hf.py::test_the_layouts_of_an_hf_model_are_those_the_plugins_run
  tests/planner/test_shard_hf.py::test_autoshard_searches_the_cuts_the_hf_plan_allows
  tests/planner/test_shard_hf.py::test_autoshard_refuses_an_hf_model_whose_plan_cuts_no_linear_it_searches)
floor() {  # "5.3.0" from the engine's constant, read without importing the engine
  .venv/bin/python -c "import runpy; g = runpy.run_path('engine/models/hf/version.py'); print('%d.%d.0' % g['$1'])"
}
TF=$(floor TRANSFORMERS_FLOOR)
PF=$(floor PEFT_FLOOR)
if [ ! -x "$DIR/bin/python" ]; then
  .venv/bin/python -m venv --system-site-packages "$DIR"
fi
OWN=$("$DIR/bin/python" -c "import site; print(site.getsitepackages()[0])")
# .venv's packages, after the floor environment's own (a .pth path line is appended to sys.path)
.venv/bin/python -c "import site; print(site.getsitepackages()[0])" > "$OWN/zz_project_venv.pth"
"$DIR/bin/python" -m pip install -q "transformers==$TF" "peft==$PF" 2>&1 | grep -v -i "warning\|requires\|incompatible" || true
"$DIR/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$ROOT" 2>&1 | grep -v -i "warning" || true
"$DIR/bin/python" -c "import transformers, peft; print('floor: transformers', transformers.__version__, '| peft', peft.__version__)"
cd "$ROOT"
exec "$DIR/bin/python" -m pytest -q -p no:cacheprovider --durations=10 "${TESTS[@]}"
