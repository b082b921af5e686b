import pytest

from octoplan.ops import Kind, Op, format_ops, parse_op, parse_ops


@pytest.mark.parametrize("text,op", [("0F0", Op(0, Kind.F, 0)), ("3I12", Op(3, Kind.I, 12)),
                                      ("3W12", Op(3, Kind.W, 12)), ("2B5", Op(2, Kind.B, 5))])
def test_parse_and_format_round_trip(text, op):
    assert parse_op(text) == op
    assert str(op) == text


@pytest.mark.parametrize("bad", ["", "F0", "0X1", "0F", "-1F0", "0f0", "0F0x", "1.5F0", "\u0663F0", "00F1", "0F01"])
def test_unknown_op_strings_are_rejected_with_the_string(bad):
    with pytest.raises(ValueError, match="unknown op"):
        parse_op(bad)


def test_op_lists_round_trip():
    text = "0F0 0F1 0I0 0W0 1B3"
    assert format_ops(parse_ops(text)) == text
    assert parse_ops("  0F0   0B0 ") == [Op(0, Kind.F, 0), Op(0, Kind.B, 0)]
