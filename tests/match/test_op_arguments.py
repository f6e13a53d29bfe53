"""Operations across frameworks, framework-free: arguments compared under the rule sets' names and one dtype
spelling, a user rule file's ``[ops]`` entries, and the operations one run inserts that change the gradient."""
from __future__ import annotations

import pytest

from layerdiff.errors import LayerdiffError
from layerdiff.match.ops import arguments_diff
from layerdiff.match.rules import builtin, load_file


def test_arguments_are_compared_under_one_name_and_one_dtype_spelling():
    names = builtin().op_arguments
    torch_call = {"args.1": -1, "kwargs.keepdim": True, "kwargs.dtype": "torch.float32"}
    paddle_call = {"args.1": -1, "kwargs.keep_dims": True, "kwargs.dtype": "paddle.float32"}
    mindspore_call = {"args.1": -1, "kwargs.keepdims": True, "kwargs.dtype": "Float32"}
    assert arguments_diff(torch_call, paddle_call, names) == {}
    assert arguments_diff(torch_call, mindspore_call, names) == {}
    # what differs is shown as each run recorded it
    assert arguments_diff({"kwargs.dtype": "torch.float32"}, {"kwargs.dtype": "paddle.bfloat16"}, names) == \
        {"kwargs.dtype": ["torch.float32", "paddle.bfloat16"]}
    assert arguments_diff({"args.1": -1}, {"args.1": [-2, -1]}, names) == {"args.1": [-1, [-2, -1]]}
    assert arguments_diff({"kwargs.axis": 1}, {"kwargs.dim": 2}, names) == {"kwargs.dim": [1, 2]}


def test_an_argument_only_one_run_passes_by_keyword_is_left_out():
    """Frameworks' defaults differ (``dropout_p=0.0`` against nothing): not a difference of the code."""
    names = builtin().op_arguments
    assert arguments_diff({"kwargs.dropout_p": 0.0, "kwargs._stacklevel": 3}, {}, names) == {}
    assert arguments_diff({"args.2": 0.5}, {}, names) == {"args.2": [0.5, None]}  # positional: the call differs


def test_a_rule_file_adds_operation_kinds_argument_names_and_fused_operations(tmp_path):
    path = tmp_path / "rules.toml"
    path.write_text('[ops.same]\nmatmul = ["my_fused_matmul"]\n\n[ops.arguments]\nreduce_axis = "dim"\n\n'
                    '[[ops.fused]]\nop = "my_swiglu"\nends = ["mul"]\nlongest = 4\n')
    rules = builtin().merged(load_file(path))
    assert rules.op_kind("my_fused_matmul") == "matmul" and rules.op_kind("batchmatmul") == "matmul"
    assert arguments_diff({"kwargs.dim": 1}, {"kwargs.reduce_axis": 1}, rules.op_arguments) == {}
    assert rules.fused_op("my_swiglu") is not None
    assert builtin().op_kind("multiply") == "mul" and builtin().op_kind("concat") == "cat"


def test_a_rule_file_with_a_bad_arguments_table_is_refused_in_one_line(tmp_path):
    path = tmp_path / "rules.toml"
    path.write_text('[ops]\narguments = ["axis"]\n')
    with pytest.raises(LayerdiffError, match=r"arguments: a table of argument name = canonical name"):
        load_file(path)
