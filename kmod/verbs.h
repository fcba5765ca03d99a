/* SPDX-License-Identifier: GPL-2.0 */
/* One handler per ioctl; each lives in the file named after its verb. */
#ifndef BUNSHIN_VERBS_H
#define BUNSHIN_VERBS_H

#include <linux/types.h>
#include <linux/compiler.h>

long bunshin_get_version(void __user *uarg);
long bunshin_share_stats(void __user *uarg);
void bunshin_share_exit(void);
long bunshin_reparent(void __user *uarg);
long bunshin_group_stats(void __user *uarg);
long bunshin_fork(void __user *uarg);
long bunshin_run(void __user *uarg);
long bunshin_join_session(void __user *uarg);

/* BUNSHIN_FEATURE() bits of the verbs main.c dispatches. */
u64 bunshin_features(void);

#endif
