"""benchmarks/profile_train_step.py attributes traced op time to source lines: checked on
a hand-written optimised-HLO fragment and trace."""

import gzip
import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location(
    "profile_train_step", os.path.join(ROOT, "benchmarks", "profile_train_step.py"))
profile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile)

HLO = """HloModule jit_step_fn

FileNames
1 "/repo/dblast_jax/models/layers.py"
2 "/repo/dblast_jax/train/step.py"

FunctionNames
1 "MLP.__call__"
2 "step_fn"

FileLocations
1 {file_name_id=1 function_name_id=1 line=146 end_line=146 column=1 end_column=2}
2 {file_name_id=2 function_name_id=2 line=112 end_line=112 column=1 end_column=2}

StackFrames
1 {file_location_id=2 parent_frame_id=1}
2 {file_location_id=1 parent_frame_id=1}

ENTRY %main {
  %ynn_fusion.3 = f32[8,8]{1,0} fusion(%a, %b), kind=kCustom, metadata={op_name="x" stack_frame_id=2}
  %add.1 = f32[8]{0} add(%c, %d), metadata={op_name="y" stack_frame_id=1}
}
"""


def test_op_time_goes_to_the_line_and_its_caller(tmp_path):
    hlo = tmp_path / "module.cpu_after_optimizations.txt"
    hlo.write_text(HLO)
    events = [{"ph": "M", "name": "thread_name", "pid": 1, "tid": 7,
               "args": {"name": "tf_XLAEigen/1"}},
              {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "python"}}]
    for _ in range(2):  # two traced steps
        events += [{"ph": "X", "pid": 1, "tid": 7, "name": "ynn_fusion.3", "dur": 3000},
                   {"ph": "X", "pid": 1, "tid": 7, "name": "add.1", "dur": 1000},
                   {"ph": "X", "pid": 1, "tid": 7, "name": "ThunkExecutor::Execute", "dur": 9e6},
                   {"ph": "X", "pid": 1, "tid": 8, "name": "ynn_fusion.3", "dur": 9e6}]
    trace = tmp_path / "vm.trace.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    op_ms, lines = profile.attribute(str(trace), str(hlo), steps=2)
    assert op_ms == 4.0  # ms per step; waits and non-XLA threads left out
    assert lines == [("layers.py:__call__:146 <- step.py:step_fn:112", 3.0),
                     ("step.py:step_fn:112", 1.0)]
