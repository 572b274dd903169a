"""specd.target_worker"""
