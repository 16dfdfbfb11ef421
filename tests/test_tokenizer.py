"""runtime/artifact/tokenizer.py against Transformers' tokenizer on the same files: same prompt text, ids and text."""

import pytest

from streamfuse.runtime.artifact.tokenizer import Tokenizer

from conftest import make_tiny_tokenizer

# SmolLM2-135M-Instruct's chat template, as its tokenizer ships it: a system turn is added when the
# first message is not one (trim_blocks and the literal newlines decide the exact text).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# (template or None for the tiny tokenizer's own, messages, add_generation_prompt)
CHATS = [
    (None, [{"role": "user", "content": "hello world"}], True),
    (None, [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}], False),
    (SMOLLM2_TEMPLATE, [{"role": "user", "content": "Summarize: #Person1#: hi\n #Person2#: n't  fine ."}], True),
    (SMOLLM2_TEMPLATE, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}], True),
]


@pytest.fixture
def saved(tmp_path):
    def save(template):
        reference = make_tiny_tokenizer()
        if template is not None:
            reference.chat_template = template
        reference.save_pretrained(tmp_path)
        return reference, Tokenizer(tmp_path)

    return save


@pytest.mark.parametrize("template, messages, generation", CHATS)
def test_chat_prompts_render_and_encode_as_transformers_does(saved, template, messages, generation):
    reference, ours = saved(template)
    text = ours.apply_chat_template(messages, add_generation_prompt=generation)
    assert text == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
    assert ours(text, add_special_tokens=False)["input_ids"] == reference(text, add_special_tokens=False)["input_ids"]


def test_decoding_and_special_tokens_match_transformers(saved):
    reference, ours = saved(None)
    ids = reference("<|im_start|> user hello world <|im_end|>", add_special_tokens=False)["input_ids"]
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    assert (ours.eos_token_id, ours.pad_token_id, len(ours), ours.vocab_size) == (
        reference.eos_token_id,
        reference.pad_token_id,
        len(reference),
        reference.vocab_size,
    )


def test_a_tokenizer_without_a_chat_template_is_a_clear_error(saved, tmp_path):
    _, ours = saved(None)
    ours.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        ours.apply_chat_template([{"role": "user", "content": "hello"}])
