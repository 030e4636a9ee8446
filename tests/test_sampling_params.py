"""SamplingParams is the one validator of sampling values: its error names the parameter (the
server's 400 passes the name on), and non-finite or overflowing numbers are refused."""
import math

import numpy as np
import pytest

import engine.sampling_params as sp
from engine.sampling_params import GREEDY_EPS, SamplingParams, SamplingParamsError


@pytest.mark.parametrize("kw, name", [
    (dict(temperature=math.inf), "temperature"), (dict(temperature=math.nan), "temperature"),
    (dict(temperature=10 ** 400), "temperature"), (dict(top_p=math.nan), "top_p"), (dict(min_p=-math.inf), "min_p"),
    (dict(repetition_penalty=1e-45), "repetition_penalty"), (dict(repetition_penalty=math.inf), "repetition_penalty"),
    (dict(presence_penalty=math.nan), "presence_penalty"), (dict(frequency_penalty=math.inf), "frequency_penalty"),
    (dict(logit_bias={1: math.nan}), "logit_bias"), (dict(logit_bias={1: 10 ** 400}), "logit_bias"),
    (dict(logit_bias={"1": 1.0}), "logit_bias"), (dict(seed=-1), "seed"), (dict(top_k=True), "top_k"),
    (dict(max_tokens=2.0), "max_tokens"), (dict(stop=[[[[1]]]]), "stop"),
])
def test_error_names_the_parameter(kw, name):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**kw)
    assert e.value.param == name and str(e.value).startswith(name + " must be") and isinstance(e.value, ValueError)


def test_vocab_and_logprobs_limits():
    p = SamplingParams(stop_token_ids=[99], logit_bias={np.int64(5): np.float32(1.5)}, logprobs=7)
    p.validate()
    p.validate(vocab_size=100, max_logprobs=7)
    with pytest.raises(SamplingParamsError, match=r"stop_token_ids must be token ids in \[0, 99\)") as e:
        p.validate(vocab_size=99)
    with pytest.raises(SamplingParamsError, match=r"max_logprobs \(6\)") as e:
        p.validate(max_logprobs=6)
    assert e.value.param == "logprobs"


def test_messages_stay_short():
    deep = []
    for _ in range(5000):  # deeper than repr can go
        deep = [deep]
    for kw in (dict(stop=[deep]), dict(max_tokens=-10 ** 5000)):
        with pytest.raises(SamplingParamsError) as e:
            SamplingParams(**kw)
        assert len(str(e.value)) < 200


def test_one_greedy_threshold():
    assert GREEDY_EPS == 1e-5 and not hasattr(SamplingParams, "greedy") and not hasattr(sp, "_GREEDY_EPS")
