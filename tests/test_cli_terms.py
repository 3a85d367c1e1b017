"""Library errors in the command's terms: argument names turned into flags."""

from __future__ import annotations

from memtrain.cli.terms import in_flag_terms


def test_library_errors_are_shown_in_flag_terms():
    assert in_flag_terms("out_dir='/a/out_dir' is a file") == "--out '/a/out_dir' is a file"
    assert in_flag_terms("pass resume=True, overwrite=True or chunked_loss=False") == (
        "pass --resume, --overwrite or --no-chunked-loss")
    assert in_flag_terms("checkpoint_every=0 must be >= 1; lower global_batch_size") == (
        "--checkpointing every:0 must be >= 1; lower --global-batch-size")
    assert in_flag_terms("world_size=2 now") == "torchrun --nproc_per_node 2 now"
    assert in_flag_terms("the precision of the run (precision='fp32')") == (
        "the precision of the run (--precision 'fp32')")
    assert in_flag_terms("pass chunked_loss=True or offload_optimizer=False; state_precision='int8'") == (
        "pass --chunked-loss or --no-offload-optimizer; --optimizer-state 'int8'")
    assert in_flag_terms("world_size=2 with fsdp=False", "plan") == "--nproc 2 with --ddp"

