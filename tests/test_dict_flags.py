"""A dict setting on the command line (`reward.paths`, `reward.weights`): one entry per flag, for an entry
the recipe holds; anything else is one `error:` line naming the flag, not the parser's box."""

import pytest

from omnirl.errors import ConfigError
from omnirl.recipe import load_config
from tests.test_bad_input import ROOT

RECIPE = str(ROOT / "yaml/sd3_tiny_flowgrpo_pickscore.yaml")


def test_an_entry_of_the_recipe_is_set():
    args = ["--reward.paths.pickscore", "/models/pickscore", "--reward.weights.pickscore=2"]
    cfg = load_config(RECIPE, args)
    assert cfg.reward.paths == {"pickscore": "/models/pickscore"} and cfg.reward.weights == {"pickscore": 2.0}


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--reward.paths", '{"pickscore": "/models/pickscore"}'],
            "--reward.paths takes one entry per flag: --reward.paths.KEY VALUE (this recipe's entries: "
            "pickscore)",
        ),
        (
            ["--reward.weights", "pickscore", "2"],
            "--reward.weights takes one entry per flag: --reward.weights.KEY VALUE (this recipe's entries: "
            "pickscore)",
        ),
        (
            ["--reward.weights.jpeg_compressibility", "1"],
            "--reward.weights.jpeg_compressibility: this recipe's reward.weights has no entry "
            "'jpeg_compressibility' (its entries: pickscore); the command line sets entries, the recipe's "
            "YAML adds them",
        ),
    ],
)
def test_a_whole_dict_or_a_new_entry_is_one_line(args, expected, capsys):
    with pytest.raises(ConfigError) as e:
        load_config(RECIPE, args)
    assert str(e.value) == expected
    assert capsys.readouterr().err == ""  # refused before the parser prints anything
