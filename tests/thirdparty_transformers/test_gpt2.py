"""transformers' model tests (its ``ModelTesterMixin``, from ``tests/test_modeling_common.py`` of
its sdist) on GPT-2, driven by a tester of ours.

The tests are transformers': every ``test_*`` of ``ModelTesterMixin`` at the installed version
(training, ``test_training_gradient_checkpointing`` and its ``use_reentrant`` True/False
variants, save/load, attention and hidden-state outputs, resizing, ...; its fx tests skip, see
below), plus the one test of our stand-in for its generation mixin
(``tests/generation/test_utils.py`` here: ``test_generate_compile_model_forward_fullgraph``,
generation with the forward compiled ``fullgraph=True`` and a static cache against eager
generation) and our ``test_torch_compile_for_training_cpu`` and ``test_training_eager_attention`` of
``extra_tests.py``. transformers' own GPT-2 test file
(``tests/models/gpt2/test_modeling_gpt2.py``) is not in its sdist: ``GPT2Tester`` and the case's
settings below are ours, written from what the mixin asks of a tester and modelled on what
transformers' model testers provide (batch 13, sequences of 7, a two-layer model of width 32,
dropout probabilities 0.1, the last token of the vocabulary as BOS, EOS and padding; the case's
flags as transformers sets them for GPT-2: ``fx_compatible = False``, which skips the fx tests
and our train-mode one, since transformers 4.57 cannot trace GPT-2 at all). Unlike transformers' GPT-2 tests, these do not
skip the three gradient-checkpointing tests (they pass plain here). Not here: ``GPT2DoubleHeadsModel``,
whose multiple-choice inputs need a tester of their own.

tests/test_thirdparty.py copies this file into ``tests/thirdparty_transformers/`` of the
unpacked sdist and runs it plain, routed and converted.
"""

import unittest

from transformers import (GPT2Config, GPT2ForQuestionAnswering, GPT2ForSequenceClassification,
                          GPT2ForTokenClassification, GPT2LMHeadModel, GPT2Model)
from transformers.testing_utils import require_torch

from ..generation.test_utils import GenerationTesterMixin
from ..test_modeling_common import ModelTesterMixin, ids_tensor, random_attention_mask
from .extra_tests import ExtraDropoutTestsMixin


class GPT2Tester:
    """Ours: a tiny GPT-2 and its inputs, for ModelTesterMixin."""

    def __init__(self, parent, batch_size=13, seq_length=7, is_training=True, vocab_size=99, hidden_size=32,
                 num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, dropout_prob=0.1,
                 max_position_embeddings=512, type_vocab_size=16):
        self.parent = parent
        self.attn_implementation = None  # extra_tests' eager-attention test sets "eager"
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.is_training = is_training
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.dropout_prob = dropout_prob
        self.max_position_embeddings = max_position_embeddings
        self.type_vocab_size = type_vocab_size
        self.special_token_id = vocab_size - 1

    def get_config(self):
        return GPT2Config(vocab_size=self.vocab_size, n_embd=self.hidden_size, n_layer=self.num_hidden_layers,
                          n_head=self.num_attention_heads, n_inner=self.intermediate_size,
                          activation_function="gelu", resid_pdrop=self.dropout_prob, embd_pdrop=self.dropout_prob,
                          attn_pdrop=self.dropout_prob, n_positions=self.max_position_embeddings,
                          initializer_range=0.02, use_cache=True, bos_token_id=self.special_token_id,
                          eos_token_id=self.special_token_id, pad_token_id=self.special_token_id,
                          attn_implementation=self.attn_implementation)

    def prepare_config_and_inputs_for_common(self):
        shape = [self.batch_size, self.seq_length]
        # No padding token among the inputs: GPT2ForSequenceClassification reads the last one.
        inputs = {"input_ids": ids_tensor(shape, self.vocab_size - 1),
                  "token_type_ids": ids_tensor(shape, self.type_vocab_size),
                  "attention_mask": random_attention_mask(shape)}
        return self.get_config(), inputs


@require_torch
class GPT2ModelTest(ModelTesterMixin, GenerationTesterMixin, ExtraDropoutTestsMixin, unittest.TestCase):
    all_model_classes = (GPT2Model, GPT2LMHeadModel, GPT2ForQuestionAnswering, GPT2ForSequenceClassification,
                         GPT2ForTokenClassification)
    # As transformers' own GPT-2 tests set it since its attention refactor: 4.57's symbolic_trace
    # cannot trace GPT-2 (masking_utils vmaps over an HFProxy), plain or not.
    fx_compatible = False
    test_missing_keys = False
    test_model_parallel = True
    compile_train_class = GPT2LMHeadModel

    def setUp(self):
        self.model_tester = GPT2Tester(self)
