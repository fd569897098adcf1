"""Rows → the JSON shapes of docs/api.md (the one place that decides the wire form)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from space.lifecycle import State, allowed_actions
from space.store import ApiKey, Operation, Sandbox, SandboxEvent, Snapshot, Template, TemplateTag


def _ts(v: datetime | None) -> str | None:
    return v.isoformat() if v is not None else None


def sandbox(sb: Sandbox) -> dict[str, Any]:
    return {
        "id": sb.id,
        "tenant": sb.tenant,
        "template": sb.template,
        "template_digest": sb.template_digest,
        "state": sb.state,
        "cpu": sb.cpu,
        "memory_mb": sb.memory_mb,
        "disk_mb": sb.disk_mb,
        "env": sb.env,
        "metadata": sb.meta,
        "node_id": sb.node_id,
        "instance_id": sb.instance_id,
        "created_at": _ts(sb.created_at),
        "updated_at": _ts(sb.updated_at),
        "terminated_at": _ts(sb.terminated_at),
        "error": {"code": sb.error_code, "message": sb.error_message} if sb.error_code else None,
        "allowed_actions": allowed_actions(State(sb.state)),
        "idle_pause_s": sb.idle_pause_s,
        "idle_suspend_s": sb.idle_suspend_s,
        "expires_at": _ts(sb.expires_at),
        "on_expire": sb.expire_action,
        "auto_resume": sb.auto_resume,
        "public_ports": sb.public_ports,
        "port_host": sb.port_host,
        "last_active_at": _ts(sb.last_active_at),
        "snapshot_policy": sb.snapshot_policy or {},
        "parent_id": sb.parent_id,
        "source_snapshot": sb.source_snapshot,
        "snapshot_id": sb.snapshot_id,
        "project": sb.project,
        "egress": sb.egress or {},
        "secrets": list(sb.secrets or []),
        "backup": backup(sb),
    }


def backup(sb: Sandbox, now: datetime | None = None) -> dict[str, Any] | None:
    """What of the sandbox is durable in object storage and how old it is (``rpo_s``: the age of
    the newest of its disk backup and its uploaded full checkpoint); None while nothing is."""
    rec = sb.backup or {}
    disk_at = datetime.fromisoformat(rec["disk_at"]) if rec.get("disk_at") else None
    memory_at = datetime.fromisoformat(rec["memory_at"]) if rec.get("memory_at") else None
    if disk_at is None and memory_at is None:
        return None
    newest = max(t for t in (disk_at, memory_at) if t is not None)
    now = now or datetime.now(UTC)
    return {"disk_at": _ts(disk_at), "memory_at": _ts(memory_at),
            "rpo_s": round(max(0.0, (now - newest).total_seconds()), 1),
            "chain": rec.get("chain"), "links": int(rec.get("seq", -1)) + 1 if rec.get("chain") else 0,
            "bytes_shipped": rec.get("bytes"), "error": rec.get("error")}


def snapshot(s: Snapshot) -> dict[str, Any]:
    where = [w for w, here in (("node", s.node_id is not None), ("object_store", s.object_key is not None)) if here]
    return {
        "id": s.id,
        "sandbox_id": s.sandbox_id,
        "kind": s.kind,
        "origin": s.origin,
        "name": s.name,
        "retain": bool(s.retain),
        "status": s.status,
        "restorable": bool(s.restorable) and s.status == "ready",
        "size_bytes": s.size_bytes,
        "location": where,
        "node_id": s.node_id,
        "template": s.template,
        "created_at": _ts(s.created_at),
        "error": s.error,
        "details": s.meta or {},
    }


def event(e: SandboxEvent) -> dict[str, Any]:
    return {"id": e.id, "at": _ts(e.at), "kind": e.kind, "message": e.message, "data": e.data or {}}


def operation(op: Operation) -> dict[str, Any]:
    return {
        "id": op.id,
        "kind": op.kind,
        "target": op.target,
        "status": op.status,
        "error": {"code": op.error_code, "message": op.error_message} if op.error_code else None,
        "progress": op.progress,
        "result": op.result,
        "attempts": op.attempts,
        "created_at": _ts(op.created_at),
        "updated_at": _ts(op.updated_at),
        "finished_at": _ts(op.finished_at),
    }


def template(t: Template) -> dict[str, Any]:
    return {
        "name": t.name,
        "digest": t.digest,
        "status": t.status,
        "size_bytes": t.size_bytes,
        # A template from a container image: the image, pinned by the digest its build used.
        "image": (t.spec or {}).get("image"),
        "error": t.error,
        "created_at": _ts(t.created_at),
        "updated_at": _ts(t.updated_at),
    }


def template_tag(t: TemplateTag) -> dict[str, Any]:
    return {"tag": t.tag, "digest": t.digest, "build_id": t.build_id, "created_at": _ts(t.created_at)}


def apikey(k: ApiKey) -> dict[str, Any]:
    return {
        "id": k.id,
        "tenant": k.tenant,
        "role": k.role,
        "name": k.name,
        "prefix": k.prefix,
        "created_at": _ts(k.created_at),
    }
