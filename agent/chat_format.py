"""Turn framing derived from the tokenizer's own chat template, so any model family works.

The template is rendered once around sentinel strings and cut into the pieces a turn is made of.
Framing pieces are tokenized with special tokens recognised; the user's and assistant's words are
tokenized as plain text (`split_special_tokens`), so a message containing `<|im_start|>` cannot forge
a turn."""

from __future__ import annotations

from dataclasses import dataclass

SYSTEM, USER1, ASSISTANT, USER2 = "\x00SYS\x00", "\x00USR1\x00", "\x00AST\x00", "\x00USR2\x00"
DEFAULT_SYSTEM = "You are a helpful assistant."


@dataclass
class ChatFormat:
    tokenizer: object
    head: str  # before the system text
    system_to_user: str  # after the system text, up to the first user text
    user_to_assistant: str  # after a user message, up to the reply (the generation prompt)
    assistant_to_user: str  # after a reply, up to the next user text (what pre-warm feeds)
    end_of_turn: list[int]  # token ids that end an assistant reply
    system_tail: str | None = None  # after a system message's text, up to the next message (None: not separable)

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "ChatFormat":
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": USER1},
            {"role": "assistant", "content": ASSISTANT},
            {"role": "user", "content": USER2},
        ]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        head, rest = text.split(SYSTEM)
        system_to_user, rest = rest.split(USER1)
        user_to_assistant, rest = rest.split(ASSISTANT)
        assistant_to_user, tail = rest.split(USER2)
        end_of_turn = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        closing = tokenizer(assistant_to_user, add_special_tokens=False).input_ids
        if closing and closing[0] in tokenizer.all_special_ids:
            end_of_turn.add(closing[0])
        alone = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}], tokenize=False)
        system_tail = alone.split(SYSTEM, 1)[1] if alone.startswith(head + SYSTEM) else None
        if system_tail is not None and not (system_to_user.startswith(system_tail) and
                                            assistant_to_user.endswith(system_to_user[len(system_tail):])):
            system_tail = None
        return cls(tokenizer, head, system_to_user, tail, assistant_to_user, sorted(end_of_turn), system_tail)

    def frame(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def words(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids

    def system_prompt(self, system: str | None) -> list[int]:
        """Everything up to the first user's words: head, system text, user header."""
        return self.frame(self.head) + self.words(system or DEFAULT_SYSTEM) + self.frame(self.system_to_user)

    def user_message(self, text: str) -> list[int]:
        """The user's words and the assistant header that asks for a reply."""
        return self.words(text) + self.frame(self.user_to_assistant)

    def assistant_reply(self, text: str) -> list[int]:
        """A reference reply fed as history (teacher forcing); its closing is fed by `next_user_header`."""
        return self.words(text)

    def next_user_header(self) -> list[int]:
        """Close the reply and open the next user turn: the fixed prefix pre-warmed after each reply."""
        return self.frame(self.assistant_to_user)

    def closing_note_header(self, note: str) -> tuple[list[int], list[int], list[int]]:
        """`next_user_header` cut in two around a system message carrying `note` (the permanent tier's
        notes): the reply's closing, the framed note, the next user header."""
        if self.system_tail is None:
            raise ValueError("this chat template has no separable system message to carry notes in")
        header = self.system_to_user[len(self.system_tail):]
        closing = self.assistant_to_user[: len(self.assistant_to_user) - len(header)]
        return (self.frame(closing), self.frame(self.head) + self.words(note) + self.frame(self.system_tail),
                self.frame(header))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
