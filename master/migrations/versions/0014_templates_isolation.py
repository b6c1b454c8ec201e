"""templates, host isolation facts, rental failure codes

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-26 02:30:00.000000

Seeds the platform's first templates (base, pytorch, jupyter, vllm). They are written here, not
read from the code, so this migration stays what it was; an admin edits or deletes them through
``PUT`` / ``DELETE /api/v1/templates/{name}``, and a deleted one stays deleted.
"""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None

SEEDS = (
    ("base", "Ubuntu 24.04 with your GPUs, kept running: open a shell in it and install what you need.",
     {"kind": "container", "image": "ubuntu:24.04", "command": ["sleep", "infinity"], "env": {}, "ports": []}),
    ("pytorch", "PyTorch 2.5.1 with CUDA 12.4 and cuDNN 9 (runtime), kept running; 8 GiB of /dev/shm for data loaders.",
     {"kind": "container", "image": "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime", "command": ["sleep", "infinity"],
      "env": {}, "ports": [], "shm_mib": 8192}),
    ("jupyter", "JupyterLab with PyTorch and CUDA 12 on port 8888. The token is JUPYTER_TOKEN from the environment; "
     "without one, Jupyter makes one up and prints it in the rental's logs.",
     {"kind": "container", "image": "quay.io/jupyter/pytorch-notebook:cuda12-2024-10-07", "command": ["start-notebook.py"],
      "args": ["--ServerApp.ip=0.0.0.0", "--ServerApp.port=8888"], "env": {}, "ports": [8888], "shm_mib": 4096}),
    ("vllm", "vLLM's OpenAI-compatible inference server on port 8000 (/v1/chat/completions), serving "
     "Qwen/Qwen2.5-0.5B-Instruct; replace --model with the model you want.",
     {"kind": "container", "image": "vllm/vllm-openai:v0.6.3",
      "args": ["--model", "Qwen/Qwen2.5-0.5B-Instruct", "--host", "0.0.0.0", "--port", "8000"], "env": {},
      "ports": [8000], "shm_mib": 8192}),
)


def upgrade() -> None:
    templates = op.create_table('templates',
    sa.Column('name', sa.String(length=40), nullable=False),
    sa.Column('description', sa.Text(), nullable=False),
    sa.Column('workload', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('name')
    )
    now = datetime.now(UTC)
    op.bulk_insert(templates, [
        {"name": name, "description": description, "workload": workload, "created_at": now, "updated_at": now}
        for name, description, workload in SEEDS
    ])
    with op.batch_alter_table('hosts', schema=None) as batch_op:
        batch_op.add_column(sa.Column('isolation', sa.JSON(), nullable=True))
    with op.batch_alter_table('rentals', schema=None) as batch_op:
        batch_op.add_column(sa.Column('failure_code', sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('rentals', schema=None) as batch_op:
        batch_op.drop_column('failure_code')
    with op.batch_alter_table('hosts', schema=None) as batch_op:
        batch_op.drop_column('isolation')
    op.drop_table('templates')
