"""The training recipe's command-line options, declared once for ``specgate heads train`` and
``specgate tune train``: heads retrained on a deployment's traffic follow the recipe the
demo's heads were trained with unless the operator says otherwise, so the two differ in their
data alone."""

from __future__ import annotations

from typing import Annotated

import typer

Steps = Annotated[int, typer.Option(min=1, help="Training steps.")]
NumHeads = Annotated[int, typer.Option(help="medusa_num_heads (Medusa only).")]
AnswerTokens = Annotated[
    int, typer.Option(min=2, help="Tokens the target writes per answer or continuation.")
]
GenerationBatch = Annotated[int, typer.Option(help="Prompts answered side by side.")]
DraftVocabSize = Annotated[
    int, typer.Option(help="Tokens the heads score (the target's most written); 0: all.")
]
RowsPerStep = Annotated[int, typer.Option(help="Positions per step (EAGLE: of the token loss).")]
SequencesPerStep = Annotated[int, typer.Option(help="Whole sequences per step (EAGLE only).")]
LearningRate = Annotated[float, typer.Option(help="Peak learning rate (cosine decay).")]

STEPS = 400
NUM_HEADS = 4
ANSWER_TOKENS = 128
GENERATION_BATCH = 64
DRAFT_VOCAB_SIZE = 8192
ROWS_PER_STEP = 256
SEQUENCES_PER_STEP = 4
LEARNING_RATE = 3e-3
