"""The unary RemoteSwap RPC of the service-remote-swap mode, as the engine's compute thread
calls it: blocking, on a sync channel of its own (the client's aio channel belongs to the event
loop's thread)."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from contract import errors
from engine_client.client.status import rpc_errors
from proto.kvcache.v1 import kvcache_pb2 as pb
from proto.kvcache.v1 import kvcache_pb2_grpc as pb_grpc


class RemoteSwapCall:
    """Calls RemoteSwap on `target`; the channel opens on the first call."""

    def __init__(
        self,
        target: str,
        options: Sequence[tuple[str, object]],
        timeout: float,
        metadata: tuple[tuple[str, str], ...],
    ) -> None:
        self._target, self._options = target, list(options)
        self._timeout, self._metadata = timeout, metadata
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.KVCacheServiceStub | None = None

    def __call__(
        self, session_id: str, epoch: int, layer: int, batch_size: int, rows_per_request: int = 1
    ) -> pb.RemoteSwapResponse:
        """One layer's swap-in run by the service; returns once its outputs are final."""
        if self._stub is None:
            self._channel = grpc.insecure_channel(self._target, options=self._options)
            self._stub = pb_grpc.KVCacheServiceStub(self._channel)
        req = pb.RemoteSwapRequest(
            session_id=session_id,
            epoch=epoch,
            layer=layer,
            batch_size=batch_size,
            rows_per_request=rows_per_request,
        )
        try:
            with rpc_errors("RemoteSwap"):
                return self._stub.RemoteSwap(req, timeout=self._timeout, metadata=self._metadata)
        except errors.KVError as e:
            # The gRPC error's frames lead back (f_back) to the compute step's, which hold the
            # mapped memory: a stored error must not keep it mapped once the service is lost.
            for cause in (e.__cause__, e.__context__):
                if cause is not None:
                    cause.__traceback__ = None
            raise

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
