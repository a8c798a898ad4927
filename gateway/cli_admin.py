# placeholder owned by the audit work: defines audit_app, db_app, keys_app
