"""transformers' model tests (its ``ModelTesterMixin``, from ``tests/test_modeling_common.py`` of
its sdist) on BERT, driven by a tester of ours.

The tests are transformers': every ``test_*`` of ``ModelTesterMixin`` at the installed version
(training, ``test_training_gradient_checkpointing`` and its ``use_reentrant`` True/False
variants, ``test_torch_fx``/``test_torch_fx_output_loss``, save/load, attention and hidden-state
outputs, resizing, ...), plus the one test of our stand-in for its generation mixin
(``tests/generation/test_utils.py`` here; BERT's LM head skips it: it cannot compile its forward
without graph breaks) and our three of ``extra_tests.py``. transformers' own BERT test file
(``tests/models/bert/test_modeling_bert.py``) is not in its sdist: ``BertTester`` and the case's
settings below are ours, written from what the mixin asks of a tester and modelled on what
transformers' model testers provide (batch 13, sequences of 7, a two-layer model of width 32,
dropout probabilities 0.1; the case's flags as transformers sets them for BERT: ``fx_compatible``).

tests/test_thirdparty.py copies this file into ``tests/thirdparty_transformers/`` of the
unpacked sdist and runs it plain, routed and converted.
"""

import unittest

import torch

from transformers import (BertConfig, BertForMaskedLM, BertForMultipleChoice, BertForNextSentencePrediction,
                          BertForPreTraining, BertForQuestionAnswering, BertForSequenceClassification,
                          BertForTokenClassification, BertLMHeadModel, BertModel)
from transformers.models.auto.modeling_auto import MODEL_FOR_PRETRAINING_MAPPING_NAMES
from transformers.models.auto import get_values
from transformers.testing_utils import require_torch, torch_device

from ..generation.test_utils import GenerationTesterMixin
from ..test_modeling_common import ModelTesterMixin, ids_tensor, random_attention_mask
from .extra_tests import ExtraDropoutTestsMixin


class BertTester:
    """Ours: a tiny BERT and its inputs, for ModelTesterMixin."""

    def __init__(self, parent, batch_size=13, seq_length=7, is_training=True, vocab_size=99, hidden_size=32,
                 num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, hidden_dropout_prob=0.1,
                 attention_probs_dropout_prob=0.1, max_position_embeddings=512, type_vocab_size=16,
                 num_choices=4):
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
        self.hidden_dropout_prob = hidden_dropout_prob
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        self.max_position_embeddings = max_position_embeddings
        self.type_vocab_size = type_vocab_size
        self.num_choices = num_choices

    def get_config(self):
        return BertConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                          num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
                          intermediate_size=self.intermediate_size, hidden_act="gelu",
                          hidden_dropout_prob=self.hidden_dropout_prob,
                          attention_probs_dropout_prob=self.attention_probs_dropout_prob,
                          max_position_embeddings=self.max_position_embeddings, type_vocab_size=self.type_vocab_size,
                          is_decoder=False, initializer_range=0.02, attn_implementation=self.attn_implementation)

    def prepare_config_and_inputs_for_common(self):
        shape = [self.batch_size, self.seq_length]
        inputs = {"input_ids": ids_tensor(shape, self.vocab_size),
                  "token_type_ids": ids_tensor(shape, self.type_vocab_size),
                  "attention_mask": random_attention_mask(shape)}
        return self.get_config(), inputs


@require_torch
class BertModelTest(ModelTesterMixin, GenerationTesterMixin, ExtraDropoutTestsMixin, unittest.TestCase):
    all_model_classes = (BertModel, BertLMHeadModel, BertForMaskedLM, BertForMultipleChoice,
                         BertForNextSentencePrediction, BertForPreTraining, BertForQuestionAnswering,
                         BertForSequenceClassification, BertForTokenClassification)
    fx_compatible = True
    model_split_percents = [0.5, 0.8, 0.9]
    compile_train_class = BertForMaskedLM

    def setUp(self):
        self.model_tester = BertTester(self)

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        inputs_dict = super()._prepare_for_class(inputs_dict, model_class, return_labels=return_labels)
        if return_labels and model_class.__name__ in get_values(MODEL_FOR_PRETRAINING_MAPPING_NAMES):
            # BertForPreTraining's two losses: masked LM and next-sentence prediction.
            batch, length = self.model_tester.batch_size, self.model_tester.seq_length
            inputs_dict["labels"] = torch.zeros((batch, length), dtype=torch.long, device=torch_device)
            inputs_dict["next_sentence_label"] = torch.zeros(batch, dtype=torch.long, device=torch_device)
        return inputs_dict
