"""ClipRequest: what generate, batch and serve accept as one clip's request, checked before any work."""

import pytest

from trt_sora.errors import ConfigError
from trt_sora.runtime.generate import ClipRequest


@pytest.mark.parametrize("prompt, match", [("", "prompt is empty"), ("   \t\n", "prompt is empty"),
                                           ("a cat\x00", "NUL"), (7, "must be a string")])
def test_bad_prompts_are_refused(prompt, match):
    with pytest.raises(ConfigError, match=match):
        ClipRequest(prompt)


@pytest.mark.parametrize("kw, match", [({"negative_prompt": "x\x00"}, "negative_prompt contains a NUL"),
                                       ({"seed": -1}, r"seed=-1 must be an integer in \[0, 2\*\*63\)"),
                                       ({"seed": True}, "seed=True"), ({"steps": 0}, "steps=0 must be"),
                                       ({"guidance": "5"}, "guidance='5' must be a number")])
def test_bad_fields_are_refused(kw, match):
    with pytest.raises(ConfigError, match=match):
        ClipRequest("a cat", **kw)


def test_from_dict_names_the_unknown_key_and_the_request():
    with pytest.raises(ConfigError, match=r"line 3: unknown key 'sed' \(did you mean 'seed'\?\); known keys: prompt"):
        ClipRequest.from_dict({"prompt": "a cat", "sed": 1}, where="line 3")
    with pytest.raises(ConfigError, match=r"body: prompt is empty"):
        ClipRequest.from_dict({"prompt": " "}, where="body")
    r = ClipRequest.from_dict({"prompt": "a cat", "seed": 3, "guidance": 1.5, "negative_prompt": ""})
    assert (r.prompt, r.seed, r.guidance, r.negative_prompt) == ("a cat", 3, 1.5, "")
