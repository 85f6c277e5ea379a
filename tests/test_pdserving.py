import ast

from app.engines.base import OcrLine, OcrResult
from app.protocols import pdserving, pipeline_http


def test_result_string_is_python_literal_with_float_coordinates():
    result = OcrResult(
        width=100,
        height=50,
        lines=(
            OcrLine("Total: 12,30 €", 0.9987, ((1, 2), (30, 2), (30, 20), (1, 20))),
            OcrLine('it\'s "quoted"', 0.5, ((1, 22), (30, 22), (30, 40), (1, 40))),
        ),
    )
    text = pdserving.result_string(result)
    assert "np." not in text
    assert text.startswith("[[('Total: 12,30 €', 0.9987), [[1.0, 2.0], [30.0, 2.0]")
    parsed = ast.literal_eval(text)
    assert parsed[1][0] == ('it\'s "quoted"', 0.5)
    assert parsed[0][1] == [[1.0, 2.0], [30.0, 2.0], [30.0, 20.0], [1.0, 20.0]]


def test_empty_result_is_empty_list():
    assert pdserving.result_string(OcrResult(width=1, height=1)) == "[]"


def test_gateway_json_shape_and_escaping():
    body = pipeline_http.render(0, "", ["result"], ["[('<a&b>', 1.0)]"])
    assert body == (
        b'{"err_no":0,"err_msg":"","key":["result"],'
        b'"value":["[(\'\\u003ca\\u0026b\\u003e\', 1.0)]"],"tensors":[]}'
    )
    assert pipeline_http.render(3002, "x") == (
        b'{"err_no":3002,"err_msg":"x","key":[],"value":[],"tensors":[]}'
    )
