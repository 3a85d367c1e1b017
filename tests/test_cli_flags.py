"""The command line's flags: a --config TOML file sets them (switches by either spelling), its bad keys and values
refused at once."""

from __future__ import annotations

import pytest

from memtrain.cli.flags import apply_config_file, build_parser
from memtrain.errors import ConfigError


def test_a_config_file_sets_the_new_flags_switches_by_either_spelling(tmp_path):
    (tmp_path / "run.toml").write_text('budget = "8MiB"\nno-chunked-loss = true\noffload-optimizer = false\n'
                                       'offload-optimizer-fraction = 0.25\nlora = 4\ncheckpointing = "Every:2"\n'
                                       'optimizer-state = "bf16"\nstep-in-backward = true\n')
    parser = build_parser()
    argv = ["train", "--config", str(tmp_path / "run.toml"), "--offload-optimizer-fraction", "0.5"]
    assert apply_config_file(parser, argv) >= {"budget", "chunked_loss", "offload_optimizer", "lora"}
    args = parser.parse_args(argv)
    assert (args.budget, args.chunked_loss, args.offload_optimizer, args.offload_optimizer_fraction, args.lora,
            args.checkpointing, args.optimizer_state, args.step_in_backward) == (
        8 * 2**20, False, False, 0.5, 4, "every:2", "bf16", True)
    (tmp_path / "bad.toml").write_text('budget = "lots"\nchunked-loss = "yes"\n')
    with pytest.raises(ConfigError) as info:
        apply_config_file(build_parser(), ["train", "--config", str(tmp_path / "bad.toml")])
    assert "'lots' is not a size" in str(info.value) and "chunked-loss = 'yes' must be true or false" in str(info.value)

