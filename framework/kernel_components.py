"""The kernel's built-in model loaders and device communicator, registered through the same hooks
a plugin uses (so ``sparrow plugins`` lists them and a plugin may replace one with
``override=True``). Import paths only: nothing heavy is imported until a worker uses one."""

from __future__ import annotations

from sparrow.hookspecs import hookimpl


@hookimpl
def sparrow_register_model_loaders(register) -> None:
    register("safetensors", "sparrow.model_loader:SafetensorsLoader")
    register("dummy", "sparrow.model_loader:DummyLoader")


@hookimpl
def sparrow_register_device_communicators(register) -> None:
    register("torch_distributed", "sparrow.distributed:TorchDistributedCommunicator")


@hookimpl
def sparrow_register_platforms(register) -> None:
    # The simulated device (sparrow.sim): always present, below every real platform for device="auto".
    register("sim", lambda: "sparrow.sim.platform:SimPlatform", priority=-1000)
