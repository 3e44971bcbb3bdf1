"""The kernel's built-in model loaders, device communicator, quantization methods and other
components, registered through the same hooks a plugin uses (so ``sparrow plugins`` lists them
and a plugin may replace one with ``override=True``). Import paths only: nothing heavy is
imported until a worker uses one."""

from __future__ import annotations

from sparrow.hookspecs import hookimpl


@hookimpl
def sparrow_register_model_loaders(register) -> None:
    register("safetensors", "sparrow.model_loader:SafetensorsLoader")
    register("dummy", "sparrow.model_loader:DummyLoader")


@hookimpl
def sparrow_register_kv_eviction_policies(register) -> None:
    register("lru", "sparrow.core.eviction:LRUPolicy")
    register("lfu", "sparrow.core.eviction:LFUPolicy")


@hookimpl
def sparrow_register_device_communicators(register) -> None:
    register("torch_distributed", "sparrow.distributed:TorchDistributedCommunicator")


@hookimpl
def sparrow_register_platforms(register) -> None:
    # The simulated device (sparrow.sim): always present, below every real platform for device="auto".
    register("sim", lambda: "sparrow.sim.platform:SimPlatform", priority=-1000)


@hookimpl
def sparrow_register_quantization_methods(register) -> None:
    register("int8", "sparrow.quantization.int8:Int8Method")
    register("fp8", "sparrow.quantization.fp8:Fp8Method")
    register("awq", "sparrow.quantization.int4:AwqMethod")
    register("gptq", "sparrow.quantization.int4:GptqMethod")


@hookimpl
def sparrow_register_spec_proposers(register) -> None:
    register("ngram", "sparrow.spec_decode.ngram:NgramProposer")
    register("draft_model", "sparrow.spec_decode.draft_model:DraftModelProposer")
    register("eagle", "sparrow.spec_decode.eagle:EagleProposer")
