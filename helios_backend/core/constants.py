"""Fixed numbers of the core format (docs/core-format.md)."""
from __future__ import annotations

MiB = 1 << 20

PAYLOAD_MAGIC = b"HELIOS-CORE\x00"      # payload carrier, CoreBody follows
LOGICAL_MAGIC = b"HELIOS-INDX\x00"      # logical-resource carrier, ProtectedIndex follows
MAGIC_NBYTES = 12
HEADER_LENGTH_NBYTES = 4                # u32 little endian
MAX_HEADER_NBYTES = 256 * MiB           # refuse absurd header lengths before allocating

PAYLOAD_FORMAT_VERSION = 2              # CoreBody.format_version
LOGICAL_AES_GCM_VERSION = 4             # ProtectedIndex.version: AES-GCM chunks
LOGICAL_ZSTD_VERSION = 6                # ProtectedIndex.version: zstd frames
LOGICAL_VERSIONS = (LOGICAL_AES_GCM_VERSION, LOGICAL_ZSTD_VERSION)

ZSTD_LEVEL = 3
CHUNK_NBYTES = 4 * MiB                  # chunk commitments cover 4 MiB of stored bytes
MAX_WINDOW_NBYTES = 8 * MiB             # decoder window cap
READ_NBYTES = 1 * MiB                   # decoded output piece size when streaming

# Domain tags: signatures are over tag || message bytes, so a signature made for
# one purpose can never verify as another.
PAYLOAD_SIGNING_TAG = b"helios/core/payload-body/v2\x00"


def logical_signing_tag(version: int) -> bytes:
    """Domain tag of a ProtectedIndex signature; binds the index version too."""
    return b"helios/core/logical-index/v%d\x00" % version


GCM_AAD_TAG = b"helios/core/gcm-chunk/v4\x00"
CONTENT_KEY_ID_TAG = b"helios/core/content-key-id\x00"
CONTENT_KEY_NBYTES = 32                 # AES-256
GCM_NONCE_PREFIX_NBYTES = 8             # + u32be chunk index = 12-byte nonce
GCM_TAG_NBYTES = 16
