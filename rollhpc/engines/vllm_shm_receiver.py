"""Worker side of ``rollhpc_shm`` (``rollhpc.engines.vllm_weight_transfer`` has the protocol and the sender).

A module of its own because vLLM imports it only where it builds the engine, on a worker that holds the model:
the plugin module that registers it is imported by every vLLM process, the front end included, which needs
none of the model loader's reload machinery.
"""

from __future__ import annotations

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine
from vllm.model_executor.model_loader.reload import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)

from rollhpc.engines.vllm_weight_transfer import ShmInitInfo, ShmUpdateInfo, _views

__all__ = ["ShmWeightTransferEngine"]


class ShmWeightTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    """Worker side of ``rollhpc_shm``: a checkpoint-format engine (layerwise reload around the chunks) whose
    chunks arrive as files in shared memory."""

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        # A private mapping: the sender's pages are read in place and never written. The views may outlive this
        # call (layerwise reload keeps a layer's arguments until the layer is complete); the mapping stays valid
        # after the sender unlinks the file, and every chunk has a file of its own, so nothing is overwritten.
        data = torch.from_file(
            update_info.path, shared=False, size=update_info.nbytes, dtype=torch.uint8
        )
        self.model.load_weights(list(_views(data, update_info)))

    def shutdown(self) -> None:
        pass
