"""specd.draft_worker"""
