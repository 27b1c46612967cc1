"""vLLM plugin entry point (``vllm.general_plugins``): registers the ``trl_async_gloo`` weight-transfer engine.

vLLM calls ``register`` in every server process when trl_async is installed in the server's environment (the CPU
server environment installs it without dependencies; see ``scripts/install_vllm_cpu.sh``). Registration is lazy: the
engine module is imported only when a server is started with ``--weight-transfer-config '{"backend":
"trl_async_gloo"}'``. On GPUs the servers use vLLM's own ``nccl`` backend and this plugin is not needed.
"""

ENGINE_NAME = "trl_async_gloo"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if ENGINE_NAME not in WeightTransferEngineFactory._registry:  # plugins may load more than once per process
        WeightTransferEngineFactory.register_engine(
            ENGINE_NAME, "trl_async.engines.vllm.weight_push.gloo_receiver", "GlooWeightTransferEngine"
        )
