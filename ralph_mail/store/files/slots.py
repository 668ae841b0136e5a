"""The slot file: a small record rewritten in place, so that a crash leaves the old one
or the new one, never a mix. It keeps the owners' cursors and the inboxes' bases.

A slot is ``seq (u64), length (u32), payload, crc32`` of what precedes the crc. The file
holds two slots of one page each; a save writes the slot the current record is *not* in
(``seq % 2``), so a kill or a power loss mid-write spoils at most that slot, and a reader
takes the valid slot with the higher seq. A single-page pwrite is not split by a signal.
Writing in place costs about a microsecond, where a temp file renamed over the old one
costs 0.94 ms on ext4 (MEASUREMENTS.md §4). Both slots get their blocks when the file is
made, so a save works on a full disk: that is when an owner must still consume its mail.
A record that outgrows its slot is written once into bigger slots, through temp file +
rename.
"""

from __future__ import annotations

import contextlib
import os
import struct
import zlib
from collections.abc import Callable

from ralph_mail.errors import StoreError
from ralph_mail.store.files.posix import open_file, replace_file, store_error, unlinked

_HEAD = struct.Struct("<QI")
_CRC = struct.Struct("<I")
PAGE = 4096
#: How much of a slot a load reads first: enough for a cursor with a few dozen marks.
_GLANCE = 512

#: Decodes a slot written in an older layout: (seq, payload) or None.
Legacy = Callable[[bytes], "tuple[int, bytes] | None"]


class SlotFile:
    """One slot file ``name`` in the directory ``directory()`` returns a descriptor on;
    ``label`` names it in errors.

    Example:
        >>> slots = SlotFile(lambda: dir_fd, "lead.cursor", "cursor of 'lead'")  # doctest: +SKIP
        >>> slots.save(b"payload"); slots.load()                         # doctest: +SKIP
        b'payload'
    """

    def __init__(
        self, directory: Callable[[], int], name: str, label: str, legacy: Legacy | None = None
    ) -> None:
        self._directory = directory  # a getter: the descriptor may be reopened meanwhile
        self.name = name
        self.label = label
        self._legacy = legacy
        self._fd = -1
        self._seq = 0
        self._slot = PAGE
        self._looked = False  # `look` found the kept file linked since the last save

    def load(self, *, keep: bool = False) -> bytes | None:
        """The newest whole record's payload; None when nothing was ever saved.

        ``keep``: read through the kept descriptor (opened for it if need be, and kept
        for the next load or save): a file read again and again (a teammate's presence,
        at each ask) costs no open and close each time.
        """
        try:
            status = os.fstat(self._fd) if keep and self._fd >= 0 else None
            if status is not None and not status.st_nlink:
                self.close()  # deleted or replaced: open the one there now
                status = None
            if status is None:
                flags = os.O_RDWR if keep else os.O_RDONLY
                fd = open_file(self.name, flags, self._directory())
                if keep:
                    self._fd = fd
                status = os.fstat(fd)
            else:
                fd = self._fd
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise store_error(exc, self.label, "read") from None
        try:
            self._slot = max(status.st_size // 2, PAGE)
            slots = [self._read_slot(fd, start) for start in (0, self._slot)]
            legacy = self._legacy is not None and any(slot.strip(b"\0") for slot in slots)
            if legacy and not any(self._decode(slot) for slot in slots):
                slots = [os.pread(fd, self._slot, start) for start in (0, self._slot)]
        finally:
            if not keep:
                os.close(fd)
        best: tuple[int, bytes] | None = None
        for slot in slots:
            found = self._decode(slot)
            if found and (best is None or found[0] > best[0]):
                best = found
        if best is None:
            if any(slot.strip(b"\0") for slot in slots):
                raise StoreError(f"{self.label} is damaged: delete it to start it afresh")
            return None
        self._seq = best[0]
        return best[1]

    def _decode(self, slot: bytes) -> tuple[int, bytes] | None:
        if len(slot) >= _HEAD.size + _CRC.size:
            seq, length = _HEAD.unpack_from(slot)
            end = _HEAD.size + length
            whole = seq and end + _CRC.size <= len(slot)
            if whole and _CRC.unpack_from(slot, end)[0] == zlib.crc32(slot[:end]):
                return seq, slot[_HEAD.size : end]
        return self._legacy(slot) if self._legacy is not None else None

    def refresh(self) -> None:
        """Learn the newest record's seq, for a file other processes save to as well (a
        save numbered below theirs would never be read). With the file open, that is a
        read of each slot's start on the kept descriptor, not an open."""
        with contextlib.suppress(StoreError, OSError):  # (the save says what is wrong)
            if self._fd >= 0 and unlinked(self._fd):
                self.close()
            if self._fd < 0:
                self.load()
                return
            for start in (0, self._slot):
                found = self._decode(self._read_slot(self._fd, start))
                if found is not None and found[0] > self._seq:
                    self._seq = found[0]

    def _read_slot(self, fd: int, start: int) -> bytes:
        # A record is small: read the start of the slot, and the rest only if needed.
        slot = os.pread(fd, _GLANCE, start)
        if len(slot) >= _HEAD.size:
            need = _HEAD.size + _HEAD.unpack_from(slot)[1] + _CRC.size
            if len(slot) < need <= self._slot:
                slot = os.pread(fd, need, start)
        return slot

    def save(self, payload: bytes, *, sync: bool = False) -> None:
        """Write ``payload`` as the newest record (fsynced with ``sync``)."""
        seq = self._seq + 1
        body = _HEAD.pack(seq, len(payload)) + payload
        body += _CRC.pack(zlib.crc32(body))
        looked, self._looked = self._looked, False
        try:
            if self._fd >= 0 and not looked and unlinked(self._fd):
                self.close()  # deleted under us (a team deleted, a cursor removed): start anew
            if len(body) > self._slot:
                self._grow(body)
            else:
                if self._fd < 0:
                    self._fd = self._open()
                os.pwrite(self._fd, body, (seq % 2) * self._slot)
                if sync:
                    os.fsync(self._fd)
        except OSError as exc:
            raise store_error(exc, self.label, "save", "nothing was changed") from None
        self._seq = seq

    def look(self) -> None:
        """Check now that the kept file is still linked (else close it), so that the next
        save need not: a waiter looks before it blocks, and the save after its wake-up,
        which a process that slept pays tens of µs per system call for, makes one fewer.
        A file deleted while it blocks takes that one save; the next one (its record is
        whole) makes the file again."""
        if self._fd >= 0:
            try:
                if unlinked(self._fd):
                    self.close()
                else:
                    self._looked = True
            except OSError:  # (the save will find out)
                pass

    def create(self) -> None:
        """Make the file with both slots' blocks allocated, if it is not there yet."""
        if self._fd < 0:
            self._fd = self._open()

    def _open(self) -> int:
        fd = open_file(self.name, os.O_RDWR | os.O_CREAT, self._directory())
        try:
            if os.fstat(fd).st_size < 2 * self._slot:
                os.posix_fallocate(fd, 0, 2 * self._slot)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _grow(self, body: bytes) -> None:
        slot = self._slot
        while slot < len(body):
            slot *= 2
        padded = body.ljust(slot, b"\0")
        replace_file(self.name, padded + padded, self._directory())
        self.close()
        self._slot = slot

    def close(self) -> None:
        """Release the kept descriptor."""
        self._looked = False
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
