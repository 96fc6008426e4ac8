"""Audit RPCs (tree heads, inclusion and consistency proofs): placeholder until implemented."""

from __future__ import annotations

from typing import Any

import grpc


class AuditRpcMixin:
    """Serves the audit RPCs of the v1 contract."""

    def _unimplemented(self, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "audit RPCs are not implemented yet")

    def GetTreeHead(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._unimplemented(context)

    def GetInclusionProof(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._unimplemented(context)

    def GetConsistencyProof(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._unimplemented(context)

    def GetPublicKey(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._unimplemented(context)
