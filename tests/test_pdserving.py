import ast

import pytest

from app.protocols import pdserving, pipeline, pipeline_http
from app.vocabulary import OcrLine, OcrResult

pytestmark = pytest.mark.unit


def test_result_string_is_python_literal_with_float_coordinates():
    result = OcrResult(
        width=100,
        height=50,
        lines=(
            OcrLine("Total: 12,30 €", 0.9987, ((1, 2), (30, 2), (30, 20), (1, 20))),
            OcrLine('it\'s "quoted"', 0.5, ((1, 22), (30, 22), (30, 40), (1, 40))),
        ),
    )
    text = pdserving.result_string(result, 0.5)
    assert "np." not in text
    assert text.startswith("[[('Total: 12,30 €', 0.9987), [[1.0, 2.0], [30.0, 2.0]")
    parsed = ast.literal_eval(text)
    assert parsed[1][0] == ('it\'s "quoted"', 0.5)
    assert parsed[0][1] == [[1.0, 2.0], [30.0, 2.0], [30.0, 20.0], [1.0, 20.0]]


def test_empty_result_is_empty_list():
    assert pdserving.result_string(OcrResult(width=1, height=1), 0.5) == "[]"


def test_lines_below_the_drop_score_are_left_out():
    low = OcrLine("noise", 0.2, ((0, 0), (1, 0), (1, 1), (0, 1)))
    high = OcrLine("text", 0.9, ((0, 0), (1, 0), (1, 1), (0, 1)))
    result = OcrResult(2, 2, (low, high))
    assert [t for (t, _), _ in ast.literal_eval(pdserving.result_string(result, 0.5))] == ["text"]
    assert len(ast.literal_eval(pdserving.result_string(result, 0.0))) == 2


def test_parse_remote_result_and_res_forms():
    result = OcrResult(9, 9, (OcrLine("a'b", 0.75, ((1, 2), (3, 2), (3, 4), (1, 4))),))
    (line,) = pdserving.parse_result_string(pdserving.result_string(result, 0.5), "result")
    assert (line.text, line.score, line.box) == ("a'b", 0.75, ((1, 2), (3, 2), (3, 4), (1, 4)))
    texts = pdserving.parse_result_string("['x', 'y']", "res")
    assert [t.text for t in texts] == ["x", "y"]
    for bad in ("__import__('os')", "[1, 2]", "{'a': 1}"):
        try:
            pdserving.parse_result_string(bad, "result")
        except (ValueError, TypeError):
            continue
        raise AssertionError(bad)


def test_gateway_json_shape_and_escaping():
    answer = pipeline.PipelineAnswer(keys=["result"], values=["[('<a&b>', 1.0)]"])
    body = pipeline_http.render(answer)
    assert body == (
        b'{"err_no":0,"err_msg":"","key":["result"],'
        b'"value":["[(\'\\u003ca\\u0026b\\u003e\', 1.0)]"],"tensors":[]}'
    )
    assert pipeline_http.render(pipeline.PipelineAnswer(err_no=3002, err_msg="x")) == (
        b'{"err_no":3002,"err_msg":"x","key":[],"value":[],"tensors":[]}'
    )
