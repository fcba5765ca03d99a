// SPDX-License-Identifier: GPL-2.0
/* /dev/bunshin: registers the device and dispatches ioctls to the verbs. */
#define pr_fmt(fmt) "bunshin: " fmt

#include <linux/module.h>
#include <linux/miscdevice.h>
#include <linux/fs.h>
#include <linux/bunshin.h>

#include "verbs.h"
#include "ksyms.h"
#include "refs.h"

struct bunshin_verb {
	unsigned int cmd;
	long (*handler)(void __user *uarg);
};

/* A verb is matched on the whole command, so a caller built with another
 * struct size gets ENOTTY rather than a misread struct. */
static const struct bunshin_verb bunshin_verbs[] = {
	{ BUNSHIN_IOC_GET_VERSION, bunshin_get_version },
	{ BUNSHIN_IOC_SHARE_STATS, bunshin_share_stats },
	{ BUNSHIN_IOC_REPARENT, bunshin_reparent },
	{ BUNSHIN_IOC_FORK, bunshin_fork },
	{ BUNSHIN_IOC_GROUP_STATS, bunshin_group_stats },
	{ BUNSHIN_IOC_RUN, bunshin_run },
	{ BUNSHIN_IOC_JOIN_SESSION, bunshin_join_session },
};

u64 bunshin_features(void)
{
	u64 bits = 0;
	size_t i;

	for (i = 0; i < ARRAY_SIZE(bunshin_verbs); i++)
		bits |= BUNSHIN_FEATURE(_IOC_NR(bunshin_verbs[i].cmd));
	return bits;
}

static long bunshin_ioctl(struct file *file, unsigned int cmd, unsigned long arg)
{
	size_t i;

	for (i = 0; i < ARRAY_SIZE(bunshin_verbs); i++)
		if (bunshin_verbs[i].cmd == cmd)
			return bunshin_verbs[i].handler((void __user *)arg);
	return -ENOTTY;
}

static const struct file_operations bunshin_fops = {
	.owner = THIS_MODULE,
	.unlocked_ioctl = bunshin_ioctl,
	.compat_ioctl = compat_ptr_ioctl,
};

static struct miscdevice bunshin_dev = {
	.minor = MISC_DYNAMIC_MINOR,
	.name = "bunshin",
	.fops = &bunshin_fops,
	.mode = 0600,
};

static int __init bunshin_init(void)
{
	int ret;

	ret = bunshin_ksyms_init();
	if (ret)
		return ret;
	bunshin_refs_init();
	ret = misc_register(&bunshin_dev);
	if (ret)
		bunshin_refs_exit();
	return ret;
}

static void __exit bunshin_exit(void)
{
	misc_deregister(&bunshin_dev);
	bunshin_share_exit();
	bunshin_refs_exit();
}

module_init(bunshin_init);
module_exit(bunshin_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("Bunshin: fork live Linux workspaces");
