"""An append-only directory of job bundles: one `<job_id>.json` file per job.

`append` never overwrites and never leaves a partial file under a bundle's name: it writes
a temporary file, fsyncs it, hard-links it to the final name (atomic, and fails if the
name exists), then fsyncs the directory. A crash at any point leaves either no bundle or
the whole bundle, plus possibly a `.tmp-*` file that `job_ids` ignores.
This module does not verify bundles; it stores and returns bytes that decode.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from receipts.bundle import Bundle, decode_bundle, encode_bundle
from receipts.errors import BundleExistsError, BundleNotFoundError, MalformedError, StoreError
from receipts.schema import check_job_id

_SUFFIX = ".json"
_TMP_PREFIX = ".tmp-"


class BundleStore:
    """Bundles on disk, keyed by job id (job ids are filename-safe by their schema rule)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def path_for(self, job_id: str) -> Path:
        return self.directory / f"{check_job_id(job_id)}{_SUFFIX}"

    def append(self, bundle: Bundle) -> Path:
        """Durably record `bundle`; return its path.

        Error handling: BundleExistsError if the job already has a bundle; StoreError
        (from the OSError) if the disk refuses. Resource handling: the temporary file is
        always removed.
        """
        final = self.path_for(bundle.job_id)
        data = encode_bundle(bundle)
        tmp = self.directory / f"{_TMP_PREFIX}{bundle.job_id}-{os.urandom(6).hex()}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, final)
            except FileExistsError as e:
                raise BundleExistsError(bundle.job_id) from e
            self._fsync_directory()
        except OSError as e:
            raise StoreError(f"cannot store bundle for job {bundle.job_id!r} in {self.directory}: {e}") from e
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        return final

    def get(self, job_id: str) -> Bundle:
        """The stored bundle for `job_id`.

        Error handling: BundleNotFoundError if none; MalformedError if the file does not decode.
        """
        path = self.path_for(job_id)
        try:
            data = path.read_bytes()
        except FileNotFoundError as e:
            raise BundleNotFoundError(job_id) from e
        except OSError as e:
            raise StoreError(f"cannot read {path}: {e}") from e
        bundle = decode_bundle(data)
        if bundle.job_id != job_id:
            raise MalformedError("bundle", f"{path.name} holds job {bundle.job_id!r}")
        return bundle

    def __contains__(self, job_id: object) -> bool:
        try:
            return isinstance(job_id, str) and self.path_for(job_id).exists()
        except MalformedError:  # not a valid job id, so never stored
            return False

    def job_ids(self) -> Iterator[str]:
        """Job ids of the stored bundles, sorted (temporary files excluded)."""
        for p in sorted(self.directory.iterdir()):
            if p.name.endswith(_SUFFIX) and not p.name.startswith("."):
                yield p.name[: -len(_SUFFIX)]

    def _fsync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
