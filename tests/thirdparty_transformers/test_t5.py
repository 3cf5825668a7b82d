"""transformers' model tests (its ``ModelTesterMixin``, from ``tests/test_modeling_common.py`` of
its sdist) on T5, driven by a tester of ours.

The tests are transformers': every ``test_*`` of ``ModelTesterMixin`` at the installed version
(training, ``test_training_gradient_checkpointing`` and its ``use_reentrant`` True/False
variants, ``test_torch_fx``/``test_torch_fx_output_loss``, save/load, attention and hidden-state
outputs, resizing, ...), plus the one test of our stand-in for its generation mixin
(``tests/generation/test_utils.py`` here: ``test_generate_compile_model_forward_fullgraph``,
generation with the forward compiled ``fullgraph=True`` and static caches against eager
generation) and our three of ``extra_tests.py``. transformers' own T5 test file
(``tests/models/t5/test_modeling_t5.py``) is not in its sdist: ``T5Tester`` and the case's
settings below are ours, written from what the mixin asks of a tester and modelled on what
transformers' model testers provide (batch 13, encoder and decoder sequences of 7, two layers
each of width 32, ``dropout_rate`` 0.1, every input sequence ending in EOS as
``T5ForSequenceClassification`` needs; the case's flags as transformers sets them for T5:
``fx_compatible``, ``is_encoder_decoder``, no head pruning).

tests/test_thirdparty.py copies this file into ``tests/thirdparty_transformers/`` of the
unpacked sdist and runs it plain, routed and converted.
"""

import unittest

from transformers import T5Config, T5ForConditionalGeneration, T5ForQuestionAnswering, T5ForSequenceClassification
from transformers import T5Model
from transformers.testing_utils import require_torch

from ..generation.test_utils import GenerationTesterMixin
from ..test_modeling_common import ModelTesterMixin, ids_tensor, random_attention_mask
from .extra_tests import ExtraDropoutTestsMixin


class T5Tester:
    """Ours: a tiny T5 and its inputs, for ModelTesterMixin."""

    def __init__(self, parent, batch_size=13, encoder_seq_length=7, decoder_seq_length=7, is_training=True,
                 vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, d_ff=37,
                 relative_attention_num_buckets=8, dropout_rate=0.1, initializer_factor=0.002, eos_token_id=1,
                 pad_token_id=0, decoder_start_token_id=0):
        self.parent = parent
        self.attn_implementation = None  # extra_tests' eager-attention test sets "eager"
        self.batch_size = batch_size
        self.encoder_seq_length = encoder_seq_length
        self.decoder_seq_length = decoder_seq_length
        self.seq_length = decoder_seq_length  # the mixin's labels are the decoder's
        self.is_training = is_training
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.d_ff = d_ff
        self.relative_attention_num_buckets = relative_attention_num_buckets
        self.dropout_rate = dropout_rate
        self.initializer_factor = initializer_factor
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.decoder_start_token_id = decoder_start_token_id

    def get_config(self):
        return T5Config(vocab_size=self.vocab_size, d_model=self.hidden_size, d_ff=self.d_ff,
                        d_kv=self.hidden_size // self.num_attention_heads, num_layers=self.num_hidden_layers,
                        num_heads=self.num_attention_heads,
                        relative_attention_num_buckets=self.relative_attention_num_buckets,
                        dropout_rate=self.dropout_rate, initializer_factor=self.initializer_factor,
                        eos_token_id=self.eos_token_id, bos_token_id=self.pad_token_id,
                        pad_token_id=self.pad_token_id, decoder_start_token_id=self.decoder_start_token_id,
                        attn_implementation=self.attn_implementation)

    def prepare_config_and_inputs_for_common(self):
        # Token ids from 2 up (neither padding nor EOS), then one EOS at each sequence's end.
        input_ids = ids_tensor([self.batch_size, self.encoder_seq_length], self.vocab_size).clamp(2)
        input_ids[:, -1] = self.eos_token_id
        decoder_input_ids = ids_tensor([self.batch_size, self.decoder_seq_length], self.vocab_size)
        attention_mask = random_attention_mask([self.batch_size, self.encoder_seq_length])
        decoder_attention_mask = random_attention_mask([self.batch_size, self.decoder_seq_length])
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "decoder_input_ids": decoder_input_ids,
                  "decoder_attention_mask": decoder_attention_mask, "use_cache": False}
        return self.get_config(), inputs


@require_torch
class T5ModelTest(ModelTesterMixin, GenerationTesterMixin, ExtraDropoutTestsMixin, unittest.TestCase):
    all_model_classes = (T5Model, T5ForConditionalGeneration, T5ForSequenceClassification, T5ForQuestionAnswering)
    fx_compatible = True
    test_pruning = False
    test_resize_embeddings = True
    is_encoder_decoder = True
    model_split_percents = [0.5, 0.8, 0.9]
    compile_train_class = T5ForConditionalGeneration

    def setUp(self):
        self.model_tester = T5Tester(self)

    def test_inputs_embeds(self):
        # T5ForSequenceClassification takes no input embeddings (it finds each sequence's EOS in input_ids).
        self.all_model_classes = tuple(cls for cls in type(self).all_model_classes
                                       if cls is not T5ForSequenceClassification)
        super().test_inputs_embeds()
