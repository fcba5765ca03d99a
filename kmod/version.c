// SPDX-License-Identifier: GPL-2.0
/* BUNSHIN_IOC_GET_VERSION */
#include <linux/module.h>
#include <linux/uaccess.h>
#include <linux/bunshin.h>

#include "verbs.h"

#define BUNSHIN_MODULE_MAJOR 0
#define BUNSHIN_MODULE_MINOR 6
#define BUNSHIN_MODULE_PATCH 0
MODULE_VERSION(__stringify(BUNSHIN_MODULE_MAJOR) "."
	       __stringify(BUNSHIN_MODULE_MINOR) "."
	       __stringify(BUNSHIN_MODULE_PATCH));

long bunshin_get_version(void __user *uarg)
{
	struct bunshin_version v;
	size_t i;

	if (copy_from_user(&v, uarg, sizeof(v)))
		return -EFAULT;
	/* Rejecting reserved bits now is what lets a later ABI give them a
	 * meaning without old modules silently ignoring them. */
	for (i = 0; i < ARRAY_SIZE(v.reserved); i++)
		if (v.reserved[i])
			return -EINVAL;

	memset(&v, 0, sizeof(v));
	v.abi_version = BUNSHIN_ABI_VERSION;
	v.module_version = BUNSHIN_VERSION_CODE(BUNSHIN_MODULE_MAJOR,
						BUNSHIN_MODULE_MINOR,
						BUNSHIN_MODULE_PATCH);
	v.features = bunshin_features();
	if (copy_to_user(uarg, &v, sizeof(v)))
		return -EFAULT;
	return 0;
}
