"""Library errors in the command's terms: argument names turned into flags."""

from __future__ import annotations

from memtrain.cli.terms import in_flag_terms


def test_library_errors_are_shown_in_flag_terms():
    assert in_flag_terms("out_dir='/a/out_dir' is a file") == "--out '/a/out_dir' is a file"
    assert in_flag_terms("pass resume=True, overwrite=True or chunked_loss=False") == (
        "pass --resume, --overwrite or --no-chunked-loss")
    assert in_flag_terms("micro_batch_size=0 must be >= 1; lower global_batch_size") == (
        "--micro-batch-size 0 must be >= 1; lower --global-batch-size")
    assert in_flag_terms("world_size=2 now") == "torchrun --nproc_per_node 2 now"
    assert in_flag_terms("the precision of the run (precision='fp32')") == (
        "the precision of the run (--precision 'fp32')")
    assert in_flag_terms("pass chunked_loss=True or offload_optimizer=False; state_precision='int8'") == (
        "pass --chunked-loss or --no-offload-optimizer; --optimizer-state 'int8'")
    assert in_flag_terms("world_size=2 with fsdp=False", "plan") == "--nproc 2 with --ddp"



def test_the_choices_fields_are_shown_as_their_flags():
    assert in_flag_terms("drop one of optimizer.placement='offload' and fsdp=True") == (
        "drop one of --offload-optimizer and --fsdp")
    assert in_flag_terms("optimizer.placement='device' with optimizer.state_precision='int8'") == (
        "--no-offload-optimizer with --optimizer-state 'int8'")
    assert in_flag_terms("optimizer.step_in_backward=True with optimizer.offload_fraction=0.5") == (
        "--step-in-backward with --offload-optimizer-fraction 0.5")
    assert in_flag_terms("optimizer.step_in_backward and offload_fraction act on gradients") == (
        "--step-in-backward and --offload-optimizer-fraction act on gradients")
    assert in_flag_terms("optimizerXplacement='offload'") == "optimizerXplacement='offload'"  # a dot is a dot
