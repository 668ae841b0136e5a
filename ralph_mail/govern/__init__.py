"""The team's rules (DESIGN §9): the Gate every write passes, the policy, approvals, presence."""
