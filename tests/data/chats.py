"""Chats and token ids the data tests share: Qwen3's special tokens and chats that exercise every branch
of the chat template."""

IM_START, IM_END, ENDOFTEXT = 151644, 151645, 151643
EMPTY_THINK_TOKENS = 4  # "<think>", "\n\n", "</think>", "\n\n"

TEMPLATE_CASES = {
    "single turn": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
    "system and multi turn": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "\n\nBye."}],
    "reasoning_content": [
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": "Because.", "reasoning_content": "\nLet me think.\n"}],
    "think inside content": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nb"},
        {"role": "user", "content": "c"}, {"role": "assistant", "content": "<think>x</think>d"}],
    "tool calls and responses": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris", "é": "<b>"}}},
            {"name": "weather", "arguments": "{\"city\": \"Rome\"}"}]},
        {"role": "tool", "content": "{\"t\": 21}"}, {"role": "tool", "content": "{\"t\": 25}"},
        {"role": "assistant", "content": "21 and 25 degrees."}],
    "user-wrapped tool response": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [
            {"name": "f", "arguments": {}}]},
        {"role": "user", "content": "<tool_response>\nok\n</tool_response>"},
        {"role": "assistant", "content": "done"}],
    "system later and tool first": [
        {"role": "tool", "content": "r"}, {"role": "system", "content": "s"}, {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"}],
    "no user turn": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}],
    "ends on user": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"},
                     {"role": "user", "content": "u2"}],
}
TEMPLATE_TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather <now>",
                                                    "parameters": {"type": "object", "properties": {}}}}]
