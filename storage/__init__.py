"""Artifact storage on fsspec URIs."""

from storage.keys import code_version, stage_key
from storage.store import ArtifactCorrupt, ArtifactRef, ArtifactStore, content_hash, sha256_file

__all__ = ["ArtifactCorrupt", "ArtifactRef", "ArtifactStore", "code_version", "content_hash", "sha256_file", "stage_key"]
