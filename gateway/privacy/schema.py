"""The privacy tables: data keys (destroyed by erasure and retention), encrypted content
(never in the chain; unreadable once its key is gone) and legal holds."""

from __future__ import annotations

import sqlalchemy as sa

from gateway.audit.schema import metadata

# One data key per data subject and UTC day, wrapped by the KEK. Destroying a key deletes
# its row: nothing else can decrypt the content or key the commitments made under it.
privacy_data_keys = sa.Table(
    "privacy_data_keys",
    metadata,
    sa.Column("key_ref", sa.String(32), primary_key=True),
    sa.Column("subject_ref", sa.String(32), nullable=False, index=True),
    sa.Column("day", sa.String(10), nullable=False),
    sa.Column("wrapped_key", sa.LargeBinary, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, index=True),
    sa.UniqueConstraint("subject_ref", "day", name="privacy_data_keys_subject_day"),
)

# Insert-only for the writer: a row goes only with its data key (the foreign key's cascade),
# in the erasure or retention transaction that destroys the key.
privacy_content = sa.Table(
    "privacy_content",
    metadata,
    sa.Column("content_id", sa.String(36), primary_key=True),
    sa.Column(
        "key_ref",
        sa.String(32),
        sa.ForeignKey(
            "privacy_data_keys.key_ref",
            name="privacy_content_key_ref_fkey",
            ondelete="CASCADE",
        ),
        nullable=False,
        index=True,
    ),
    sa.Column("part", sa.String(16), nullable=False),
    sa.Column("ciphertext", sa.LargeBinary, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
)

privacy_holds = sa.Table(
    "privacy_holds",
    metadata,
    sa.Column("subject_ref", sa.String(32), primary_key=True),
    sa.Column("placed_at", sa.DateTime(timezone=True), nullable=False),
)
