"""The communication: options that fit an inlined (run.reuse_layer_graph=false) pipelined tensor-parallel twin
together: tests/dryrun/test_communication.py compiles them, tests/unit/test_communication_keys.py validates them."""

INLINED_OPTIONS = [
    "communication.micro_batch_interleave=2",
    "communication.grad_matmul_communication_overlap=true",
    "communication.grad_computation_allreduce_overlap=true",
    "communication.pp_1f1b_overlap=true",
    "communication.enable_allreduce_slice_to_reducescatter=true",
    "communication.enable_communication_fusion=true",
    "communication.computation_communication_fusion_level=1",
]
