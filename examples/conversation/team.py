"""A conversation in Python: the coordinator asks the analyst a question and delegates a
draft to the writer; both run in threads here (in real life: other processes, an LLM CLI
behind ``ralph-mail run``), and their answers come back. In a temporary home::

    python examples/conversation/team.py
"""

from __future__ import annotations

import tempfile
import threading

from ralph_mail import MessageBus, MessageType, create_team


def main() -> int:
    home = tempfile.mkdtemp(prefix="ralph-conversation-")
    try:
        create_team("office", ["coordinator", ("analyst", "knows the numbers"),
                               ("writer", "drafts posts")], home=home)  # fmt: skip
        analyst, writer = (
            MessageBus("office", "analyst", home),
            MessageBus("office", "writer", home),
        )
        analyst.set_presence("idle")
        writer.set_presence("idle")

        def answer() -> None:  # the analyst answers one question
            for message in analyst.wait_for_messages(timeout=30):
                if message.type == MessageType.REQUEST:
                    analyst.reply(message, f"Q4 revenue was $2.4M ({message.metadata['context']})")

        def draft() -> None:  # the writer takes one task
            assignment = writer.wait_for_message(MessageType.TASK_ASSIGNMENT, timeout=30)
            assert assignment is not None
            task_id = assignment.metadata["taskId"]
            writer.start(task_id)
            writer.complete(task_id, "Saved as 'Q4 Blog Post Draft'")

        helpers = [threading.Thread(target=answer), threading.Thread(target=draft)]
        for helper in helpers:
            helper.start()
        coordinator = MessageBus("office", "coordinator", home)
        reply = coordinator.ask("analyst", "What was Q4 revenue?", context="investor update",
                                timeout=30)  # fmt: skip
        print(f"analyst says: {reply.content}")
        since = coordinator.store.size("coordinator")
        task = coordinator.delegate("writer", "Draft the Q4 blog post", id="T-100")
        result = coordinator.wait_for_result(task, timeout=30, since=since)
        print(f"writer says: {result.content if result else 'nothing'}")
        for helper in helpers:
            helper.join(30)
        print([(t.id, t.status) for t in coordinator.tasks()])
        return 0 if result is not None else 1
    finally:
        import shutil

        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
